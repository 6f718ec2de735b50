/**
 * gRPC-Web from browsers (`@connectrpc/connect-web`, over `fetch`).
 *
 * The broker itself does not serve gRPC-Web yet: point
 * this at a gRPC-Web proxy in front of it (e.g. Envoy's grpc_web filter), or
 * at the broker once it does. Reads need a session like any other call; keep
 * agent keys out of the browser and let it read with a reader's short-lived
 * session.
 *
 * ```ts
 * import { createWebTransport } from "@delegation-broker/client/web";
 * const client = createBrokerClient(createWebTransport("https://broker.example"));
 * ```
 */
import { createGrpcWebTransport, type GrpcWebTransportOptions } from "@connectrpc/connect-web";
import type { Transport } from "@connectrpc/connect";

/** A gRPC-Web transport (binary protobuf) to `baseUrl`. */
export function createWebTransport(
  baseUrl: string,
  options: Omit<GrpcWebTransportOptions, "baseUrl"> = {},
): Transport {
  return createGrpcWebTransport({ useBinaryFormat: true, ...options, baseUrl });
}

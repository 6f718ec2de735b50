/**
 * gRPC over HTTP/2 from Node (`@connectrpc/connect-node`), plaintext or TLS.
 *
 * ```ts
 * import { createNodeTransport } from "@delegation-broker/client/node";
 * const transport = createNodeTransport("127.0.0.1:50051");                    // plaintext
 * const tls = createNodeTransport("https://broker.example:50051", { ca: readFileSync("ca.pem") });
 * ```
 */
import { createGrpcTransport, type GrpcTransportOptions } from "@connectrpc/connect-node";
import type { Transport } from "@connectrpc/connect";

export interface NodeTransportOptions extends Omit<GrpcTransportOptions, "baseUrl"> {
  /**
   * PEM certificate(s) to trust for an `https://` broker (its self-signed
   * certificate or its CA); default: Node's trust store. Shorthand for
   * `nodeOptions: { ca }`.
   */
  ca?: string | Uint8Array;
}

/**
 * A gRPC transport (HTTP/2) to the broker at `address`: `host:port` as
 * `serve` prints it (plaintext), or a URL — `http://host:port`, or
 * `https://host:port` for a broker with `[tls]`.
 */
export function createNodeTransport(address: string, options: NodeTransportOptions = {}): Transport {
  const { ca, nodeOptions, ...rest } = options;
  const baseUrl = address.includes("://") ? address : `http://${address}`;
  return createGrpcTransport({
    ...rest,
    baseUrl,
    nodeOptions: ca === undefined ? nodeOptions : { ...nodeOptions, ca: typeof ca === "string" ? ca : Buffer.from(ca) },
  });
}

/**
 * Clients of the Broker service over any connect-es transport (gRPC from
 * Node: `./node`'s `createNodeTransport`; gRPC-Web from browsers: `./web`'s
 * `createWebTransport`), with the broker's errors as {@link BrokerError} and,
 * optionally, a read session on every call.
 */

import type { DescMessage, DescMethodStreaming, DescMethodUnary, MessageInitShape } from "@bufbuild/protobuf";
import { Code, createClient, type Client, type StreamResponse, type Transport, type UnaryResponse } from "@connectrpc/connect";
import type { ContextValues } from "@connectrpc/connect";

import { BrokerError } from "./errors.js";
import { Broker } from "./gen/delegation/broker/v1/broker_pb.js";
import { PUBLIC_METHODS, RenewingSession, SESSION_HEADER, type RenewingSessionOptions, type SessionSource } from "./session.js";
import type { Agent } from "./signing.js";

/** A promise client of `delegation.broker.v1.Broker`: `client.delegate(request)`, `client.watch(request)`, ... */
export type BrokerClient = Client<typeof Broker>;

async function* brokerErrors<T>(messages: AsyncIterable<T>): AsyncGenerator<T> {
  try {
    yield* messages;
  } catch (error) {
    throw BrokerError.from(error);
  }
}

function needsNewSession(error: BrokerError): boolean {
  return error.code === Code.Unauthenticated && (error.reason === "SESSION_EXPIRED" || error.reason === "BAD_SESSION");
}

/**
 * `transport` whose calls fail with {@link BrokerError} (a ConnectError with
 * the broker's ErrorInfo decoded) and, with `session`, carry that read
 * session on every call but OpenSession and GetBrokerKeys (unless the call's
 * own headers carry one). With a {@link RenewingSession}, a unary call
 * refused with SESSION_EXPIRED or BAD_SESSION (a session the broker no longer
 * accepts: expired early by a clock, or signed by a key since rotated) is
 * sent once more with a renewed session: reads are safe to repeat.
 */
export function brokerTransport(transport: Transport, options: { session?: SessionSource } = {}): Transport {
  const session = options.session;
  const headersFor = async (method: { name: string }, header: HeadersInit | undefined, renewed = false) => {
    const headers = new Headers(header);
    if (session !== undefined && !PUBLIC_METHODS.has(method.name) && (renewed || !headers.has(SESSION_HEADER))) {
      headers.set(SESSION_HEADER, await session.headerValue());
    }
    return headers;
  };
  return {
    async unary<I extends DescMessage, O extends DescMessage>(
      method: DescMethodUnary<I, O>,
      signal: AbortSignal | undefined,
      timeoutMs: number | undefined,
      header: HeadersInit | undefined,
      input: MessageInitShape<I>,
      contextValues?: ContextValues,
    ): Promise<UnaryResponse<I, O>> {
      const ownSession = new Headers(header).has(SESSION_HEADER);
      try {
        return await transport.unary(method, signal, timeoutMs, await headersFor(method, header), input, contextValues);
      } catch (caught) {
        const error = BrokerError.from(caught);
        if (!(session instanceof RenewingSession) || ownSession || !needsNewSession(error)) throw error;
        await session.renew();
        try {
          return await transport.unary(method, signal, timeoutMs, await headersFor(method, header, true), input, contextValues);
        } catch (again) {
          throw BrokerError.from(again);
        }
      }
    },
    async stream<I extends DescMessage, O extends DescMessage>(
      method: DescMethodStreaming<I, O>,
      signal: AbortSignal | undefined,
      timeoutMs: number | undefined,
      header: HeadersInit | undefined,
      input: AsyncIterable<MessageInitShape<I>>,
      contextValues?: ContextValues,
    ): Promise<StreamResponse<I, O>> {
      let response: StreamResponse<I, O>;
      try {
        response = await transport.stream(method, signal, timeoutMs, await headersFor(method, header), input, contextValues);
      } catch (caught) {
        throw BrokerError.from(caught);
      }
      return {
        stream: true,
        service: response.service,
        method: response.method,
        header: response.header,
        trailer: response.trailer,
        message: brokerErrors(response.message),
      };
    },
  };
}

/**
 * A client of the broker over `transport` whose calls fail with
 * {@link BrokerError}; with `session`, every call carries it (see
 * {@link brokerTransport}).
 */
export function createBrokerClient(transport: Transport, options: { session?: SessionSource } = {}): BrokerClient {
  return createClient(Broker, brokerTransport(transport, options));
}

/**
 * A client whose reads are `agent`'s: a {@link RenewingSession} opened now
 * (so a broker that refuses it fails here) and renewed lazily, on the first
 * call after `renewAt` of its lifetime; `client.session` is it.
 */
export async function sessionClient(
  transport: Transport,
  agent: Agent,
  options: RenewingSessionOptions = {},
): Promise<BrokerClient & { readonly session: RenewingSession }> {
  const session = new RenewingSession(agent, createBrokerClient(transport), options);
  await session.current();
  const client = createBrokerClient(transport, { session });
  return Object.assign(client, { session });
}

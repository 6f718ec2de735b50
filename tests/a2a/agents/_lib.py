"""What the test agents share: serving an AgentExecutor with the official A2A
Python SDK (a2a-sdk 1.3.0: its DefaultRequestHandler, its Starlette JSON-RPC
and agent-card routes, served by uvicorn, and optionally its GrpcHandler on a
grpc.aio server, the same handler and task store behind both), a log of every
request received on either binding, and calling another agent with the SDK's
client (JSON-RPC, or gRPC when asked).

Nothing here knows the delegation broker. The only trace of the extension is
that a caller may pass `terms` through to its outbound message's metadata
under the extension's URI, and reads back what a returned task's metadata
says under that URI (an agent is free to read metadata it was handed); the
URI is a plain string to these agents.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import grpc
import grpc.aio
import httpx
import uvicorn
from google.protobuf import json_format
from google.rpc import error_details_pb2, status_pb2
from starlette.applications import Starlette
from uvicorn._compat import asyncio_run

from a2a.client import ClientCallContext, ClientConfig, ClientFactory
from a2a.client.transports.grpc import GrpcTransport
from a2a.client.transports.tenant_decorator import TenantTransportDecorator
from a2a.helpers import new_data_part, new_text_part
from a2a.server.agent_execution import AgentExecutor
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.request_handlers.grpc_handler import GrpcHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore
from a2a.types import a2a_pb2_grpc
from a2a.types.a2a_pb2 import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
    CancelTaskRequest,
    GetTaskRequest,
    Message,
    Role,
    SendMessageRequest,
    Task,
    TaskState,
)
from a2a.utils.errors import A2AError

# The extension's URI: metadata under it is read from answers and, when a
# caller asks for terms, written into outbound messages. A plain string here.
EXTENSION_URI = "urn:delegation-broker:a2a:delegation:v1"

TERMINAL = {
    TaskState.TASK_STATE_COMPLETED,
    TaskState.TASK_STATE_CANCELED,
    TaskState.TASK_STATE_FAILED,
    TaskState.TASK_STATE_REJECTED,
}
INTERRUPTED = {TaskState.TASK_STATE_INPUT_REQUIRED, TaskState.TASK_STATE_AUTH_REQUIRED}


# --------------------------------------------------------------------------
# The request log: one JSON line per event, appended and flushed at once
# --------------------------------------------------------------------------


class EventLog:
    def __init__(self, path: str | None):
        self._file = open(path, "a", buffering=1, encoding="utf-8") if path else None  # noqa: SIM115

    def write(self, **entry: Any) -> None:
        entry = {"t": round(time.time(), 6), **entry}
        line = json.dumps(entry, sort_keys=True)
        if self._file is not None:
            self._file.write(line + "\n")
            self._file.flush()


def _abridged(value: Any, depth: int = 0) -> Any:
    """A JSON value with long strings cut (to 80 characters) and deep nesting dropped."""
    if isinstance(value, str):
        return value if len(value) <= 80 else value[:80] + f"...({len(value)} chars)"
    if depth >= 4:
        return "..."
    if isinstance(value, dict):
        return {k: _abridged(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_abridged(v, depth + 1) for v in value[:16]]
    return value


def _describe_rpc(body: bytes) -> dict[str, Any]:
    """What a JSON-RPC request asked: its method and the task/context ids it names."""
    try:
        request = json.loads(body)
    except ValueError:
        return {"method": None, "unparsed": body[:200].decode(errors="replace")}
    if not isinstance(request, dict):
        return {"method": None, "unparsed": str(request)[:200]}
    params = request.get("params") if isinstance(request.get("params"), dict) else {}
    return {"method": request.get("method"), "rpcId": request.get("id"), **_describe_params(params)}


def _describe_params(params: dict[str, Any]) -> dict[str, Any]:
    """The ids a request's params (JSON-RPC `params`, or a gRPC request as
    proto3 JSON: the same field names) name, and its message's extension
    fields: the same keys whichever binding carried it."""
    out: dict[str, Any] = {}
    if params.get("tenant"):
        out["tenant"] = params.get("tenant")
    message = params.get("message")
    if isinstance(message, dict):
        out["messageId"] = message.get("messageId")
        out["taskId"] = message.get("taskId")
        out["contextId"] = message.get("contextId")
        out["extensions"] = message.get("extensions") or []
        metadata = message.get("metadata")
        out["metadataKeys"] = sorted(metadata) if isinstance(metadata, dict) else []
        out["metadata"] = _abridged(metadata) if isinstance(metadata, dict) else {}
    elif "id" in params:
        out["taskId"] = params.get("id")
    return out


class RequestLog:
    """ASGI middleware: logs every HTTP request before the app sees it (a
    JSON-RPC request with its method and ids), then hands the app the very
    body it read. So an empty log proves nothing reached the agent."""

    def __init__(self, app: Any, log: EventLog):
        self.app = app
        self.log = log

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        received: list[dict] = []
        body = b""
        while True:
            message = await receive()
            received.append(message)
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        entry: dict[str, Any] = {"kind": "http", "http": f"{scope['method']} {scope['path']}"}
        if scope["method"] == "POST":
            entry["kind"] = "rpc"
            entry["binding"] = "jsonrpc"
            entry.update(_describe_rpc(body))
        self.log.write(**entry)
        pending = iter(received)

        async def replay() -> dict:
            try:
                return next(pending)
            except StopIteration:
                return await receive()

        await self.app(scope, replay, send)


class GrpcRequestLog(grpc.aio.ServerInterceptor):
    """The gRPC binding's counterpart of RequestLog: a server interceptor that
    logs every call (kind `rpc`, `binding` `grpc`, the method's short name and
    the same ids and extension fields) before the SDK's GrpcHandler sees it.
    The handler is given the raw bytes and the request is decoded here, so
    even a request that does not decode, or a method the SDK does not serve,
    leaves its line."""

    def __init__(self, log: EventLog):
        self.log = log

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        method = details.method.rsplit("/", 1)[-1]
        handler = await continuation(details)
        if handler is None:
            self.log.write(kind="rpc", binding="grpc", method=method, path=details.method, unserved=True)
            return None
        log = self.log

        def decode(raw: bytes) -> Any:
            try:
                request = handler.request_deserializer(raw) if handler.request_deserializer else raw
            except Exception as error:  # noqa: BLE001
                log.write(kind="rpc", binding="grpc", method=method, unparsed=f"{type(error).__name__}: {error}")
                return None
            params = json_format.MessageToDict(request) if hasattr(request, "DESCRIPTOR") else {}
            log.write(kind="rpc", binding="grpc", method=method, **_describe_params(params))
            return request

        if handler.unary_unary is not None:
            behavior = handler.unary_unary

            async def unary_unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
                request = decode(raw)
                if request is None:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the request does not decode")
                return await behavior(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, request_deserializer=None, response_serializer=handler.response_serializer
            )
        if handler.unary_stream is not None:
            stream = handler.unary_stream

            async def unary_stream(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
                request = decode(raw)
                if request is None:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the request does not decode")
                async for item in stream(request, context):
                    yield item

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, request_deserializer=None, response_serializer=handler.response_serializer
            )
        # A2AService has no client-streaming methods; log it and pass it on.
        self.log.write(kind="rpc", binding="grpc", method=method, streamingRequest=True)
        return handler


# --------------------------------------------------------------------------
# Serving
# --------------------------------------------------------------------------


def agent_card(
    name: str, url: str, description: str, skill: str, grpc_url: str | None = None, streaming: bool = True
) -> AgentCard:
    interfaces = [AgentInterface(url=url, protocol_binding="JSONRPC", protocol_version="1.0")]
    if grpc_url:
        interfaces.append(AgentInterface(url=grpc_url, protocol_binding="GRPC", protocol_version="1.0"))
    return AgentCard(
        name=name,
        description=description,
        version="1.0.0",
        supported_interfaces=interfaces,
        # A stock agent streams (the SDK serves SendStreamingMessage and
        # SubscribeToTask); with streaming False the SDK refuses both.
        capabilities=AgentCapabilities(streaming=streaming, push_notifications=False),
        default_input_modes=["text/plain", "application/json"],
        default_output_modes=["application/json", "text/plain"],
        skills=[AgentSkill(id=skill, name=skill, description=description, tags=["test"])],
    )


def serve(
    executor_factory: Callable[[EventLog], AgentExecutor],
    *,
    name: str,
    description: str,
    skill: str,
    port: int,
    log_path: str | None,
    grpc_port: int | None = None,
    streaming: bool = True,
) -> None:
    """Binds 127.0.0.1:port (0 picks one), prints `agent on http://127.0.0.1:PORT`
    on stdout, and serves the executor until SIGTERM/SIGINT. With `grpc_port`
    (0 picks one) it serves the gRPC binding too, on a grpc.aio server in the
    same event loop with the same request handler, lists it in its card
    (`GRPC`, `127.0.0.1:GRPCPORT`, after the JSON-RPC interface) and prints
    `agent grpc on 127.0.0.1:GRPCPORT` after the first line. `streaming`
    is the card's `capabilities.streaming` (False: the SDK refuses
    SendStreamingMessage and SubscribeToTask)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit it: uvicorn writes a response's headers
    # and body apart, and with Nagle the body would wait for the client's
    # delayed ACK (40 ms on a kept-alive connection).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)
    bound = sock.getsockname()[1]
    url = f"http://127.0.0.1:{bound}"
    log = EventLog(log_path)
    log_level = os.environ.get("AGENT_LOG_LEVEL", "warning")

    def build(grpc_url: str | None) -> tuple[DefaultRequestHandler, uvicorn.Server]:
        card = agent_card(name, url + "/", description, skill, grpc_url, streaming)
        handler = DefaultRequestHandler(
            agent_executor=executor_factory(log),
            task_store=InMemoryTaskStore(),
            agent_card=card,
        )
        routes = [*create_agent_card_routes(card), *create_jsonrpc_routes(handler, rpc_url="/")]
        app = Starlette(routes=routes)
        config = uvicorn.Config(
            RequestLog(app, log),
            log_level=log_level,
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
        return handler, uvicorn.Server(config)

    if grpc_port is None:
        _, server = build(None)
        log.write(kind="start", url=url, name=name)
        print(f"agent on {url}", flush=True)
        server.run(sockets=[sock])
        return

    async def both() -> None:
        grpc_server = grpc.aio.server(interceptors=[GrpcRequestLog(log)])
        grpc_bound = grpc_server.add_insecure_port(f"127.0.0.1:{grpc_port}")
        grpc_addr = f"127.0.0.1:{grpc_bound}"
        handler, server = build(grpc_addr)
        a2a_pb2_grpc.add_A2AServiceServicer_to_server(GrpcHandler(handler), grpc_server)
        await grpc_server.start()
        log.write(kind="start", url=url, grpc=grpc_addr, name=name)
        print(f"agent on {url}", flush=True)
        print(f"agent grpc on {grpc_addr}", flush=True)
        try:
            # uvicorn's serve() handles SIGTERM/SIGINT (a graceful stop, then
            # the signal raised again); the gRPC server goes with the process.
            await server.serve(sockets=[sock])
        finally:
            await grpc_server.stop(1)

    asyncio_run(both(), loop_factory=uvicorn.Config(None).get_loop_factory())


def stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# Reading messages and tasks
# --------------------------------------------------------------------------


def data_parts(message: Message | None) -> list[Any]:
    if message is None:
        return []
    return [json_format.MessageToDict(part.data) for part in message.parts if part.HasField("data")]


def text_of(message: Message | None) -> str:
    if message is None:
        return ""
    return "\n".join(part.text for part in message.parts if part.HasField("text"))


def integers(value: Any) -> Any:
    """protobuf Values are doubles: 60.0 back to 60 where whole."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: integers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [integers(v) for v in value]
    return value


def extension_metadata(task: Task) -> dict[str, Any]:
    metadata = json_format.MessageToDict(task.metadata) if task.HasField("metadata") else {}
    ext = metadata.get(EXTENSION_URI)
    return integers(ext) if isinstance(ext, dict) else {}


def first_output(task: Task) -> Any:
    """The first data part of the task's first artifact (else its text, else None)."""
    for artifact in task.artifacts:
        for part in artifact.parts:
            if part.HasField("data"):
                return integers(json_format.MessageToDict(part.data))
            if part.HasField("text"):
                return part.text
    return None


# --------------------------------------------------------------------------
# Calling another agent (the SDK's client, card resolution included)
# --------------------------------------------------------------------------


async def call_agent(
    base_url: str,
    *,
    context_id: str,
    text: str,
    terms: dict[str, Any] | None = None,
    timeout_s: float = 120.0,
    poll_s: float = 0.1,
    verdict_wait_s: float = 5.0,
    return_immediately: bool = False,
    cancel_after_s: float | None = None,
    log: EventLog | None = None,
    binding: str = "jsonrpc",
) -> dict[str, Any]:
    """Sends one task-starting message to the agent at `base_url` (its card at
    `<base_url>/.well-known/agent-card.json`), follows the task with GetTask
    until it settles, and says how it ended. With `return_immediately` the
    SendMessage asks not to wait for the task (A2A's configuration flag); with
    `cancel_after_s` the caller sends CancelTask that long after the first
    answer (`canceled` then holds the state CancelTask answered). Outcome:
    {state, verdict, error, errorType, errorData, contractId, failedChecks,
    receiptId, output, taskId, statusText, canceled, binding, tenant,
    errorCode, errorReason, errorDomain}: a task that ended COMPLETED or
    FAILED without a verdict in its metadata is read again for up to
    `verdict_wait_s`. Never raises for the callee's or the network's failures: they are the outcome.

    `binding` "jsonrpc" (the SDK's default: JSON-RPC only) or "grpc": the
    client then supports only GRPC (`supported_protocol_bindings`, channels
    from grpc.aio.insecure_channel), so a card without a GRPC interface is an
    error, not a fallback. `binding` in the outcome is the binding the SDK's
    client chose ("JSONRPC"/"GRPC"), `tenant` the interface's tenant (the SDK
    sends it in every request). A gRPC error's status code name, and its
    google.rpc.ErrorInfo's reason, domain and metadata (the SDK keeps them
    only for the domain a2a-protocol.org), are read from the status details
    here: `errorCode`, `errorReason`, `errorDomain`, `errorData`."""
    outcome: dict[str, Any] = {
        "state": None,
        "verdict": None,
        "error": None,
        "errorType": None,
        "errorData": None,
        "contractId": None,
        "failedChecks": None,
        "receiptId": None,
        "output": None,
        "taskId": None,
        "canceled": None,
        "binding": None,
        "tenant": None,
        "errorCode": None,
        "errorReason": None,
        "errorDomain": None,
    }
    if binding not in BINDINGS:
        raise ValueError(f"binding {binding!r}: one of {BINDINGS}")
    deadline = time.monotonic() + timeout_s

    def call_context() -> ClientCallContext | None:
        # gRPC calls have no deadline unless given one; JSON-RPC keeps the httpx timeout.
        if binding != "grpc":
            return None
        return ClientCallContext(timeout=max(1.0, deadline - time.monotonic()))

    # The SDK's own default timeout is 5 s: far too short for a task that
    # waits on other agents.
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s)) as http:
        client = None
        try:
            if binding == "grpc":
                config = ClientConfig(
                    httpx_client=http,
                    streaming=False,
                    supported_protocol_bindings=["GRPC"],
                    use_client_preference=True,
                    grpc_channel_factory=grpc.aio.insecure_channel,
                )
            else:
                config = ClientConfig(httpx_client=http, streaming=False)
            factory = ClientFactory(config)
            client = await factory.create_from_url(base_url)
            outcome["binding"], outcome["tenant"] = client_binding(client)
            message = Message(
                role=Role.ROLE_USER,
                message_id=str(uuid.uuid4()),
                context_id=context_id,
                parts=[new_text_part(text)],
            )
            if terms:
                message.metadata.update({EXTENSION_URI: {"terms": terms}})
                message.extensions.append(EXTENSION_URI)
            task: Task | None = None
            request = SendMessageRequest(message=message)
            request.configuration.return_immediately = return_immediately
            async for response in client.send_message(request, context=call_context()):
                if response.HasField("task"):
                    task = response.task
                elif response.HasField("message"):
                    outcome["output"] = text_of(response.message) or data_parts(response.message)
                    outcome["state"] = "MESSAGE"
                    return outcome
            if task is None:
                outcome["error"] = "the agent answered neither a task nor a message"
                return outcome
            if log is not None:
                log.write(kind="answered", url=base_url, taskId=task.id, state=TaskState.Name(task.status.state))
            if cancel_after_s is not None and task.status.state not in TERMINAL:
                await asyncio.sleep(cancel_after_s)
                canceled = await client.cancel_task(CancelTaskRequest(id=task.id), context=call_context())
                outcome["canceled"] = TaskState.Name(canceled.status.state)
                if log is not None:
                    log.write(kind="canceled-peer", url=base_url, taskId=task.id, state=outcome["canceled"])
                task = canceled
            # Follow until settled, then (bounded) until a judged end carries its verdict.
            verdict_wait_until: float | None = None
            while True:
                state = task.status.state
                ext = extension_metadata(task)
                if state in INTERRUPTED:
                    break
                if state in TERMINAL:
                    if "verdict" in ext or state in (TaskState.TASK_STATE_CANCELED, TaskState.TASK_STATE_REJECTED):
                        break
                    verdict_wait_until = verdict_wait_until or min(deadline, time.monotonic() + verdict_wait_s)
                    if time.monotonic() >= verdict_wait_until:
                        break
                if time.monotonic() >= deadline:
                    outcome["error"] = f"gave up after {timeout_s} s with the task {TaskState.Name(state)}"
                    break
                await asyncio.sleep(poll_s)
                task = await client.get_task(GetTaskRequest(id=task.id), context=call_context())
            ext = extension_metadata(task)
            outcome.update(
                state=TaskState.Name(task.status.state),
                verdict=ext.get("verdict"),
                contractId=ext.get("contractId"),
                failedChecks=ext.get("failedChecks"),
                receiptId=ext.get("receiptId"),
                output=first_output(task),
                taskId=task.id,
                statusText=text_of(task.status.message) if task.status.HasField("message") else None,
            )
        except A2AError as error:
            outcome["error"] = error.message if getattr(error, "message", None) else str(error)
            outcome["errorType"] = type(error).__name__
            outcome["errorData"] = integers(error.data) if error.data else None
            outcome.update(grpc_error_fields(error, outcome["errorData"]))
        except Exception as error:  # noqa: BLE001 -- the outcome of the call, whatever it was
            outcome["error"] = f"{type(error).__name__}: {error}"
            outcome["errorType"] = type(error).__name__
            outcome.update(grpc_error_fields(error, None))
        finally:
            if client is not None:
                try:
                    await client.close()  # a gRPC channel; a shared httpx client stays open
                except Exception:  # noqa: BLE001
                    pass
    return outcome


def client_binding(client: Any) -> tuple[str, str | None]:
    """The binding the SDK's client chose (its transport) and the tenant it sends."""
    transport = getattr(client, "_transport", None)
    tenant = None
    if isinstance(transport, TenantTransportDecorator):
        tenant = transport._tenant
        transport = transport._base
    if isinstance(transport, GrpcTransport):
        return "GRPC", tenant
    name = type(transport).__name__
    return ("JSONRPC" if "JsonRpc" in name else name), tenant


def find_rpc_error(error: BaseException | None) -> grpc.RpcError | None:
    """The gRPC error an SDK error was raised from (its __cause__/__context__ chain)."""
    seen = 0
    while error is not None and seen < 10:
        if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
            return error
        error = error.__cause__ or error.__context__
        seen += 1
    return None


def grpc_status_details(rpc_error: Any) -> status_pb2.Status | None:
    """The google.rpc.Status in a gRPC error's trailers (grpc-status-details-bin)."""
    try:
        trailers = rpc_error.trailing_metadata() or ()
    except Exception:  # noqa: BLE001
        return None
    for key, value in trailers:
        if key == "grpc-status-details-bin":
            return status_pb2.Status.FromString(value)
    return None


def error_infos(status: status_pb2.Status | None) -> list[error_details_pb2.ErrorInfo]:
    out = []
    for detail in status.details if status is not None else []:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            out.append(info)
    return out


def grpc_error_fields(error: BaseException, data: Any) -> dict[str, Any]:
    """errorCode/errorReason/errorDomain (and errorData when the SDK kept none)
    of an error that came back over gRPC; nothing for any other error."""
    rpc_error = find_rpc_error(error)
    if rpc_error is None:
        return {}
    out: dict[str, Any] = {"errorCode": rpc_error.code().name}
    infos = error_infos(grpc_status_details(rpc_error))
    info = next((i for i in infos if i.domain != "a2a-protocol.org"), infos[0] if infos else None)
    if info is not None:
        out["errorReason"] = info.reason
        out["errorDomain"] = info.domain
        if not data and info.metadata:
            out["errorData"] = dict(info.metadata)
    return out


BINDINGS = ("jsonrpc", "grpc")


def add_binding_args(parser: Any) -> None:
    """--grpc-port and --outbound-binding, shared by the agents."""
    parser.add_argument(
        "--grpc-port",
        type=int,
        default=None,
        help="serve the gRPC binding too, on this port (0 picks one); prints `agent grpc on 127.0.0.1:PORT`",
    )
    parser.add_argument(
        "--outbound-binding",
        choices=BINDINGS,
        default=os.environ.get("A2A_OUTBOUND_BINDING") or "jsonrpc",
        help="the binding of the agent's own calls to other agents (default $A2A_OUTBOUND_BINDING, else jsonrpc); "
        "grpc takes the card's GRPC interface and nothing else",
    )


def result_part(value: Any):
    return new_data_part(value)

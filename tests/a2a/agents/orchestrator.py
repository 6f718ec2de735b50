"""A stock A2A orchestrator agent (a2a-sdk 1.3.0), knowing nothing of the broker.

    python orchestrator.py --port 0 --outbound-base http://EGRESS --peers worker-a,worker-b [--log FILE]
                           [--grpc-port N] [--outbound-binding jsonrpc|grpc]

Prints `agent on http://127.0.0.1:PORT` once listening (with --grpc-port,
then `agent grpc on 127.0.0.1:PORT`: the gRPC binding served too). On a task
it calls each peer NAME at `<outbound-base>/peers/NAME` with the SDK's client
(card resolution over HTTP, then JSON-RPC, or with --outbound-binding grpc
(default $A2A_OUTBOUND_BINDING) the card's GRPC interface and its tenant),
all at once, each with the SAME contextId as its own task, and completes with
one artifact of one data part:

    {"results": {NAME: {"state": <final TaskState name, e.g. TASK_STATE_COMPLETED>,
                        "verdict": <metadata[URI].verdict of the returned task, or null>,
                        "error": <the error's text, or null>,
                        ... errorType, errorData, contractId, failedChecks, output, taskId,
                        binding, tenant, errorCode, errorReason, errorDomain}}}

The incoming message's first data part may steer it:
    {"peers": [NAME, ...],                 # instead of --peers
     "terms": {NAME: {...}},               # sent as metadata[URI].terms to that peer
     "sequential": true,                   # one peer after the other, in order
     "returnImmediately": true,            # SendMessage asks not to wait for the task (then GetTask)
     "cancelAfterMs": {NAME: N}}           # CancelTask to that peer N ms after its first answer
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _lib import EventLog, add_binding_args, call_agent, data_parts, integers, result_part, serve, stderr, text_of  # noqa: E402

from a2a.helpers import new_task_from_user_message, new_text_part  # noqa: E402
from a2a.server.agent_execution import AgentExecutor, RequestContext  # noqa: E402
from a2a.server.events import EventQueue  # noqa: E402
from a2a.server.tasks import TaskUpdater  # noqa: E402


class OrchestratorExecutor(AgentExecutor):
    def __init__(self, args: argparse.Namespace, log: EventLog):
        self.args = args
        self.log = log

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        args = self.args
        steer = next((d for d in data_parts(context.message) if isinstance(d, dict)), {})
        steer = integers(steer)
        peers = steer.get("peers") or [p for p in args.peers.split(",") if p]
        terms = steer.get("terms") or {}
        self.log.write(
            kind="execute",
            taskId=context.task_id,
            contextId=context.context_id,
            followUp=context.current_task is not None,
            text=text_of(context.message),
            peers=peers,
            terms=terms,
        )
        stderr(f"execute {context.task_id} peers={','.join(peers)}")
        if context.current_task is None:
            await event_queue.enqueue_event(new_task_from_user_message(context.message))
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        await updater.start_work()

        base = args.outbound_base.rstrip("/")
        cancel_after_ms = steer.get("cancelAfterMs") or {}

        async def one(name: str) -> dict:
            outcome = await call_agent(
                f"{base}/peers/{name}",
                context_id=context.context_id,
                text=f"{text_of(context.message) or 'answer the question'} (part for {name})",
                terms=terms.get(name),
                return_immediately=bool(steer.get("returnImmediately")),
                cancel_after_s=cancel_after_ms[name] / 1000 if name in cancel_after_ms else None,
                log=self.log,
                timeout_s=args.call_timeout_s,
                verdict_wait_s=args.verdict_wait_s,
                binding=args.outbound_binding,
            )
            self.log.write(kind="called", peer=name, outcome=outcome)
            return outcome

        if steer.get("sequential"):
            outcomes = [await one(name) for name in peers]
        else:
            outcomes = await asyncio.gather(*(one(name) for name in peers))
        results = dict(zip(peers, outcomes, strict=True))
        await updater.add_artifact([result_part({"results": results})], name="results")
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        self.log.write(kind="cancel", taskId=context.task_id, contextId=context.context_id)
        stderr(f"cancel {context.task_id}")
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        await updater.cancel(updater.new_agent_message([new_text_part("canceled")]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--outbound-base", required=True, help="the gateway's egress base URL, http://HOST:PORT")
    parser.add_argument("--peers", default="", help="comma-separated peer names (default fan-out)")
    parser.add_argument("--name", default="orchestrator")
    parser.add_argument("--log", default=None)
    parser.add_argument("--call-timeout-s", type=float, default=120.0)
    parser.add_argument("--verdict-wait-s", type=float, default=5.0,
                        help="how long to re-read a task that ended without a verdict in its metadata")
    add_binding_args(parser)
    args = parser.parse_args()
    serve(
        lambda log: OrchestratorExecutor(args, log),
        name=args.name,
        description="test orchestrator: fans a task out to its peers",
        skill="orchestrate",
        port=args.port,
        log_path=args.log,
        grpc_port=args.grpc_port,
    )


if __name__ == "__main__":
    main()

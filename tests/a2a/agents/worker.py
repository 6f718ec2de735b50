"""A stock A2A worker agent (a2a-sdk 1.3.0), knowing nothing of the broker.

    python worker.py --port 0 --mode good|bad|input|slow|call-peer [--log FILE]
                     [--name NAME] [--delay-ms N] [--outbound URL] [--peer-terms JSON]
                     [--grpc-port N] [--outbound-binding jsonrpc|grpc]
                     [--stream-steps N [--step-ms M]] [--no-streaming]

Prints `agent on http://127.0.0.1:PORT` once listening (with --grpc-port,
then `agent grpc on 127.0.0.1:PORT`: the gRPC binding served too, listed in
the card after the JSON-RPC interface). Modes:
- good: WORKING, then COMPLETED with one artifact of one data part {"answer": 42};
- bad: the same with {"answer": "forty-two"} (fails a schema asking an integer);
- input: WORKING, then INPUT_REQUIRED with the status message "need the date
  range"; a follow-up message on that task completes it with {"answer": 42};
- slow: WORKING until canceled (at most --slow-max-s, then FAILED); its
  cancel() logs `cancel <task_id>` on stderr and a {"kind": "cancel"} line in
  the log, and moves the task to CANCELED;
- call-peer: calls the agent at --outbound (its gateway's egress
  `/peers/NAME`) with the SDK's client, with the same contextId as its own
  task, and completes with {"call": <outcome>} (state, verdict, error text, …).
--delay-ms delays good/bad/call-peer's end.

--stream-steps N (good and bad; default 0: off) makes the task stream: after
WORKING, N steps, each a WORKING status update with the message "step I of
N" and an artifact update of the artifact `answer` (id and name) with one
data part {"partial": I, "of": N}, --step-ms apart (default 200); then the
artifact `answer` once more with the mode's final part (it replaces the
partial ones: the task ends with one artifact of one part, as without
steps), then COMPLETED. A task-starting message's data part may ask other
numbers for its task ({"steps": N, "stepMs": M}), and {"appendBytes": K}
makes each step also append a text part of K bytes to the artifact `long`
(a task that keeps growing). Each step is logged
({"kind": "step", "step": I, "of": N}) before its events are sent, and
{"kind": "finished"} before the final status. Only the SDK's TaskUpdater
emits the events: a streaming client (SendStreamingMessage, SubscribeToTask)
gets them as they are sent; CancelTask mid-way ends the task CANCELED. The
card says `capabilities.streaming: true` (as every agent's does by default);
--no-streaming says false, and the SDK then refuses SendStreamingMessage and
SubscribeToTask (the agent is only polled). The log (--log) gets one JSON
line per request received on either binding (`binding` jsonrpc|grpc, method,
taskId, contextId, extensions and metadata keys of the message), and per
execute/cancel. --outbound-binding (default $A2A_OUTBOUND_BINDING, else
jsonrpc) is call-peer's client's binding: grpc takes the card's GRPC
interface only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _lib import EventLog, add_binding_args, call_agent, data_parts, result_part, serve, stderr, text_of  # noqa: E402

from a2a.helpers import new_task_from_user_message, new_text_part  # noqa: E402
from a2a.server.agent_execution import AgentExecutor, RequestContext  # noqa: E402
from a2a.server.events import EventQueue  # noqa: E402
from a2a.server.tasks import TaskUpdater  # noqa: E402
from a2a.types.a2a_pb2 import TaskState  # noqa: E402

MODES = ("good", "bad", "input", "slow", "call-peer")


class WorkerExecutor(AgentExecutor):
    def __init__(self, args: argparse.Namespace, log: EventLog):
        self.args = args
        self.log = log

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        args = self.args
        task = context.current_task
        self.log.write(
            kind="execute",
            mode=args.mode,
            taskId=context.task_id,
            contextId=context.context_id,
            followUp=task is not None,
            text=text_of(context.message),
            data=data_parts(context.message),
        )
        stderr(f"execute {context.task_id} {args.mode}")
        if task is None:
            await event_queue.enqueue_event(new_task_from_user_message(context.message))
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)

        if task is not None and task.status.state == TaskState.TASK_STATE_INPUT_REQUIRED:
            # The follow-up an input-required task asked for.
            await updater.start_work()
            await updater.add_artifact([result_part({"answer": 42})], name="answer")
            await updater.complete()
            return

        await updater.start_work()
        if args.mode == "slow":
            # Stays WORKING; the framework cancels this coroutine and calls cancel().
            await asyncio.sleep(args.slow_max_s)
            await updater.failed(updater.new_agent_message([new_text_part("slow worker gave up waiting")]))
            return
        if args.delay_ms:
            await asyncio.sleep(args.delay_ms / 1000)
        steps, step_ms = self.stream_plan(context)
        if args.mode in ("good", "bad") and steps:
            final = {"answer": 42} if args.mode == "good" else {"answer": "forty-two"}
            await self.stream_steps(context, updater, steps, step_ms, final)
        elif args.mode == "good":
            await updater.add_artifact([result_part({"answer": 42})], name="answer")
            await updater.complete()
        elif args.mode == "bad":
            await updater.add_artifact([result_part({"answer": "forty-two"})], name="answer")
            await updater.complete()
        elif args.mode == "input":
            await updater.requires_input(updater.new_agent_message([new_text_part("need the date range")]))
        elif args.mode == "call-peer":
            outcome = await call_agent(
                args.outbound,
                context_id=context.context_id,
                text=f"sub-task of {args.name}: answer the question",
                terms=json.loads(args.peer_terms) if args.peer_terms else None,
                timeout_s=args.call_timeout_s,
                verdict_wait_s=args.verdict_wait_s,
                binding=args.outbound_binding,
            )
            self.log.write(kind="called", url=args.outbound, outcome=outcome)
            await updater.add_artifact([result_part({"call": outcome})], name="call")
            await updater.complete()

    def stream_plan(self, context: RequestContext) -> tuple[int, float]:
        """How many steps the task streams and how far apart (ms): the
        message's {"steps", "stepMs"} when it asks, else --stream-steps and
        --step-ms; no steps unless --stream-steps is set."""
        steps, step_ms = self.args.stream_steps, float(self.args.step_ms)
        if not steps:
            return 0, 0.0
        for data in data_parts(context.message):
            if isinstance(data, dict):
                steps = int(data.get("steps", steps))
                step_ms = float(data.get("stepMs", step_ms))
        return max(0, steps), max(0.0, step_ms)

    async def stream_steps(
        self, context: RequestContext, updater: TaskUpdater, steps: int, step_ms: float, final: dict
    ) -> None:
        """N WORKING status updates and N replacements of the artifact
        `answer`, step_ms apart, then the final artifact and COMPLETED. A
        message's {"appendBytes": K} also appends a text part of K bytes to
        the artifact `long` at each step (a task that keeps growing)."""
        append_bytes = 0
        for data in data_parts(context.message):
            if isinstance(data, dict):
                append_bytes = max(0, int(data.get("appendBytes", append_bytes)))
        for step in range(1, steps + 1):
            self.log.write(kind="step", taskId=context.task_id, contextId=context.context_id, step=step, of=steps)
            await updater.update_status(
                TaskState.TASK_STATE_WORKING,
                message=updater.new_agent_message([new_text_part(f"step {step} of {steps}")]),
            )
            await updater.add_artifact(
                [result_part({"partial": step, "of": steps})], artifact_id="answer", name="answer"
            )
            if append_bytes:
                await updater.add_artifact(
                    [new_text_part("x" * append_bytes)], artifact_id="long", name="long", append=step > 1
                )
            await asyncio.sleep(step_ms / 1000)
        await updater.add_artifact([result_part(final)], artifact_id="answer", name="answer")
        self.log.write(kind="finished", taskId=context.task_id, contextId=context.context_id, steps=steps)
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        self.log.write(kind="cancel", taskId=context.task_id, contextId=context.context_id)
        stderr(f"cancel {context.task_id}")
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        await updater.cancel(updater.new_agent_message([new_text_part("canceled")]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--name", default="worker")
    parser.add_argument("--log", default=None, help="JSON-lines log of every request and execute/cancel")
    parser.add_argument("--delay-ms", type=int, default=0)
    parser.add_argument("--slow-max-s", type=float, default=600.0)
    parser.add_argument("--outbound", default=None, help="call-peer: the peer's base URL (gateway egress /peers/NAME)")
    parser.add_argument("--peer-terms", default=None, help="call-peer: JSON object sent as the extension's terms")
    parser.add_argument("--call-timeout-s", type=float, default=120.0)
    parser.add_argument("--verdict-wait-s", type=float, default=5.0,
                        help="how long to re-read a task that ended without a verdict in its metadata")
    parser.add_argument("--stream-steps", type=int, default=0,
                        help="good/bad: stream N WORKING updates and partial artifacts before the end (0: off)")
    parser.add_argument("--step-ms", type=int, default=200, help="--stream-steps: the pause after each step")
    parser.add_argument("--no-streaming", action="store_true",
                        help="the card says capabilities.streaming false (the SDK then refuses streaming calls)")
    add_binding_args(parser)
    args = parser.parse_args()
    if args.mode == "call-peer" and not args.outbound:
        parser.error("--mode call-peer needs --outbound URL")
    if args.stream_steps < 0 or args.step_ms < 0:
        parser.error("--stream-steps and --step-ms are not negative")
    if args.stream_steps and args.mode not in ("good", "bad"):
        parser.error("--stream-steps is for --mode good or bad")
    if args.stream_steps and args.no_streaming:
        parser.error("--stream-steps streams: not with --no-streaming")
    serve(
        lambda log: WorkerExecutor(args, log),
        name=args.name,
        description=f"test worker ({args.mode}{', streaming' if args.stream_steps else ''})",
        skill=f"worker-{args.mode}",
        port=args.port,
        log_path=args.log,
        grpc_port=args.grpc_port,
        streaming=not args.no_streaming,
    )


if __name__ == "__main__":
    main()

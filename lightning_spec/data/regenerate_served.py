"""Regenerate the target's training answers through the servers that serve it.

`data.regenerate` answers the training prompts with the target's batched ``generate`` inside
this process. A team that serves the target already runs engines built for exactly this work
(vLLM, SGLang, llama.cpp's ``llama-server``), often as several replicas on a GPU cluster; this
module sends the same prompts to any number of OpenAI-compatible servers and writes the same
records into the same `RolloutStore`, so nothing downstream knows where the answers came from.

* **Exact tokens.** Each prompt is rendered here with the target's chat template
  (`render_prompt`, as `regenerate` does) and sent as token ids: ``POST /v1/completions`` with
  ``prompt: [ids]`` and ``return_token_ids: true`` (vLLM answers ``choices[0].token_ids``), or
  llama.cpp's native ``POST /completion`` with ``return_tokens: true`` (``tokens``). Where a
  server returns only text, the text is tokenized here and the round trip
  ``decode(tokenize(text)) == text`` is checked; failures are counted (the record keeps the
  tokenized text). A server that refuses token-id prompts (found by a one-token probe before any
  work) is sent the prompt's text.
* **Turns.** An item whose messages hold several user turns is answered turn by turn on one
  server: turn k's prompt is the conversation up to its user message, with the earlier
  assistant turns replaced by the target's own replies (the dataset's answers are never sent).
  Its record is the last prompt and its answer, every regenerated answer in it marked for the
  loss. An item with one user turn gives exactly the record `regenerate` writes.
* **Sampling.** Greedy at temperature 0; otherwise temperature, top_p (top_k when set) and a
  seed drawn from (seed, prompt id, turn) go to the server, so a rerun asks for the same draws.
* **Many servers.** ``concurrency`` workers per server take conversations from one shared queue
  (a faster server takes more). A request without a usable answer (no connection, a timeout, a
  5xx, a body that is not JSON or lacks a completion's fields) is retried with exponential
  backoff, then handed to a server that has not failed it; a server that fails
  ``max_failures`` conversations in a row leaves the rotation while the others go on. A 4xx
  (the prompt is too long for the server's context, say) is the prompt's own fault: skipped
  without a retry and counted.
* **Resumable.** Records go to the store shard by shard (`RolloutStore.write_shard`: a shard
  counts once the manifest lists it), ids already stored are skipped and ids are claimed in
  batches (`data.claims`), so a killed run resumes without sending a stored prompt again and
  processes sharing one store split the prompts.

The store's configuration (its hash) is the caller's, as for `regenerate`: the answers are the
target's whichever engine computed them, so a store made here is the one a later ``fit``
without servers finds complete. The servers' wire formats (requests, replies, the probe) are
`data.served_protocol`; the HTTP calls themselves are `lightning_spec.http_json`.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_spec.data.chat import render_prompt, render_prompt_masked
from lightning_spec.data.claims import claimed_batches
from lightning_spec.data.records import RolloutRecord
from lightning_spec.data.regenerate import (
    GenerationSettings,
    PromptItem,
    RegenerationReport,
    ShardBuffer,
)
from lightning_spec.data.rollouts import RolloutStore
from lightning_spec.data.served_protocol import (
    PROBE_TOKENS,
    RETRYABLE_CLIENT_CODES,
    GarbageReply,
    Reply,
    Server,
    answer_tokens,
    check_servers,
    completion_request,
    end_of_turn_id,
    parse_reply,
    parse_server_urls,
    probe_prompt_form,
)
from lightning_spec.data.shards import ShardInfo
from lightning_spec.http_json import RequestFailed, post_json
from lightning_spec.progress import progress_bar

__all__ = ["ServedRegenerationReport", "ServerReport", "regenerate_served"]

log = logging.getLogger(__name__)

Message = dict[str, str]

# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------


@dataclass
class ServerReport:
    """What one server did in a run."""

    url: str
    api: str
    model: str
    prompt_as_text: bool = False
    answered: int = 0
    """Conversations whose record came from this server."""
    requests: int = 0
    """Completion requests sent, retries included (the probe not)."""
    failed_requests: int = 0
    """Requests without a usable answer (no connection, timeout, 5xx, garbage)."""
    new_tokens: int = 0
    in_rotation: bool = True
    """False: it failed too many conversations in a row and was left out."""
    tokens_per_second: float = 0.0
    """Its new tokens over the run's wall time: its share of the throughput."""


@dataclass
class ServedRegenerationReport(RegenerationReport):
    """`RegenerationReport` (``generated`` = answered) plus what servers add."""

    skipped: dict[str, int] = field(default_factory=dict)
    """Unanswered prompts by reason: ``rejected`` (a 4xx), ``failed`` (no usable answer from
    any server that tried), ``no_server`` (no server left in the rotation), ``error`` (an
    unexpected error while handling an answer; the log has it). ``too_long`` is counted in
    ``too_long``, as `regenerate` does."""
    retokenized: int = 0
    """Answers given as text only and tokenized here."""
    retokenization_failures: int = 0
    """Of those, answers whose text did not survive ``decode(tokenize(text))``."""
    servers: dict[str, ServerReport] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# The work queue
# --------------------------------------------------------------------------------------------


@dataclass
class _Job:
    item: PromptItem
    tried: set[int] = field(default_factory=set)
    """Servers that failed this conversation."""


@dataclass
class _Outcome:
    job: _Job
    server: int | None
    record: RolloutRecord | None = None
    skipped: str | None = None
    server_fault: bool = False
    detail: str = ""
    new_tokens: int = 0
    retokenized: int = 0
    round_trip_failures: int = 0


class _Dispatch:
    """The shared queue of conversations: a worker takes the first its server has not failed; a
    conversation a server failed goes back for the servers that have not, and a server failing
    `max_failures` conversations in a row leaves the rotation. Outcomes go to `outcomes`, read
    by the thread that writes the store."""

    def __init__(self, urls: Sequence[str], max_failures: int) -> None:
        self.urls = list(urls)
        self.max_failures = max_failures
        self.cond = threading.Condition()
        self.queue: deque[_Job] = deque()
        self.live = [True] * len(urls)
        self.failures = [0] * len(urls)
        self.busy = 0
        self.stopped = False
        self.outcomes: queue.Queue[_Outcome] = queue.Queue()

    def _candidates(self, job: _Job) -> bool:
        return any(live and index not in job.tried for index, live in enumerate(self.live))

    def _sweep(self) -> None:
        """Queued conversations no server in the rotation may take any more: unanswered."""
        kept: deque[_Job] = deque()
        for job in self.queue:
            if self._candidates(job):
                kept.append(job)
            else:
                reason = "failed" if any(self.live) else "no_server"
                self.outcomes.put(_Outcome(job, None, skipped=reason))
        self.queue = kept

    def add(self, items: Sequence[PromptItem]) -> None:
        with self.cond:
            self.queue.extend(_Job(item) for item in items)
            self._sweep()
            self.cond.notify_all()

    def waiting(self) -> int:
        with self.cond:
            return len(self.queue)

    def idle(self) -> bool:
        with self.cond:
            return not self.queue and self.busy == 0

    def any_live(self) -> bool:
        with self.cond:
            return any(self.live)

    def is_live(self, server: int) -> bool:
        with self.cond:
            return self.live[server]

    def take(self, server: int) -> _Job | None:
        """The next conversation for `server` (blocking); None once it left or the run ends."""
        with self.cond:
            while not self.stopped and self.live[server]:
                for index, job in enumerate(self.queue):
                    if server not in job.tried:
                        del self.queue[index]
                        self.busy += 1
                        return job
                self.cond.wait(0.2)
            return None

    def finish(self, server: int, outcome: _Outcome) -> None:
        """Hand in what `server` made of a conversation it took."""
        with self.cond:
            self.busy -= 1
            if outcome.server_fault:
                self.failures[server] += 1
                outcome.job.tried.add(server)
                if self.live[server] and self.failures[server] >= self.max_failures:
                    self.live[server] = False
                    log.warning(
                        "%s leaves the rotation: %d conversations in a row got no usable "
                        "answer (last: %s)%s",
                        self.urls[server], self.failures[server], outcome.detail,
                        "; the other servers go on" if any(self.live) else "; no server is left",
                    )  # fmt: skip
                if self._candidates(outcome.job):
                    self.queue.appendleft(outcome.job)  # another server may answer it
                else:
                    outcome.skipped = "failed" if any(self.live) else "no_server"
                    self.outcomes.put(outcome)
            else:
                if outcome.skipped != "too_long":  # it answered (not asked when too long)
                    self.failures[server] = 0
                self.outcomes.put(outcome)
            self._sweep()
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()


class _Rejected(Exception):
    """A 4xx: the server refuses this request."""


class _NoAnswer(Exception):
    """No usable answer after every retry."""


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def _request_seed(seed: int, prompt_id: str, turn: int) -> int:
    digest = hashlib.sha256(f"{seed}|{prompt_id}|{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def _turn_segments(item: PromptItem) -> list[list[Message]] | None:
    """The messages each turn adds (each ends with its user message), the dataset's assistant
    turns left out; None for an item given as token ids (one turn)."""
    if item.input_ids is not None:
        return None
    messages = [dict(m) for m in item.messages or [] if m.get("role") != "assistant"]
    segments: list[list[Message]] = []
    current: list[Message] = []
    for message in messages:
        current.append(message)
        if message.get("role") == "user":
            segments.append(current)
            current = []
    # messages after the last user turn have nothing to answer them; none at all: one prompt
    return segments or [messages]


class _ServedRun:
    """One `regenerate_served` call: its settings, servers, counters and workers."""

    def __init__(
        self,
        servers: Sequence[Server],
        tokenizer: Any,
        *,
        settings: GenerationSettings,
        max_length: int | None,
        eos_ids: Sequence[int],
        retries: int,
        backoff: float,
        timeout: float,
        dispatch: _Dispatch,
        report: ServedRegenerationReport,
    ) -> None:
        self.servers = list(servers)
        self.tokenizer = tokenizer
        # a fast tokenizer is not safe to call from several threads at once
        self.tokenizer_lock = threading.Lock()
        self.settings = settings
        self.max_length = max_length
        self.eos_ids = list(eos_ids)
        self.end_of_turn = end_of_turn_id(tokenizer, self.eos_ids)
        self.retries = retries
        self.backoff = backoff
        self.timeout = timeout
        self.dispatch = dispatch
        self.report = report
        self.stats_lock = threading.Lock()

    # ------------------------------------------------------------------ one request
    def _server_stats(self, server: int) -> ServerReport:
        return self.report.servers[self.servers[server].url]

    def ask(self, server_index: int, ids: list[int], budget: int, seed: int) -> Reply:
        """One completion, retried with backoff; `_Rejected` on a 4xx, `_NoAnswer` when no
        try gave a usable answer (or the server left the rotation meanwhile)."""
        server = self.servers[server_index]
        text = None
        if server.prompt_as_text:
            with self.tokenizer_lock:
                text = self.tokenizer.decode(ids, skip_special_tokens=False,
                                             clean_up_tokenization_spaces=False)  # fmt: skip
        path, body = completion_request(
            server, ids, text, settings=self.settings, max_new_tokens=budget, seed=seed
        )
        last = "not sent: the server left the rotation"
        for attempt in range(self.retries + 1):
            if attempt:
                if not self.dispatch.is_live(server_index):
                    break
                time.sleep(self.backoff * 2 ** (attempt - 1))
            with self.stats_lock:
                self._server_stats(server_index).requests += 1
            try:
                answer = post_json(server.url + path, body, timeout=self.timeout)
                return parse_reply(server.api, answer)
            except RequestFailed as failure:
                if failure.client_error and failure.status not in RETRYABLE_CLIENT_CODES:
                    raise _Rejected(str(failure)) from None
                last = str(failure)
            except GarbageReply as failure:
                last = f"not a completion: {failure}"
            with self.stats_lock:
                self._server_stats(server_index).failed_requests += 1
        raise _NoAnswer(last)

    # ------------------------------------------------------------------ one conversation
    def answer(self, server: int, job: _Job) -> _Outcome:
        """Every turn of `job` on `server`; the record, or why there is none."""
        item = job.item
        segments = _turn_segments(item)
        turns = 1 if segments is None else len(segments)
        history: list[Message] = []
        prompt_history: list[Message] = []
        answers: list[tuple[list[int], str]] = []
        prompt_ids: list[int] = []
        outcome = _Outcome(job, server)
        for turn in range(turns):
            if segments is not None:
                history.extend(segments[turn])
            with self.tokenizer_lock:
                ids = (
                    list(item.input_ids)
                    if item.input_ids is not None
                    else render_prompt(self.tokenizer, history)
                )
            if self.max_length is not None and len(ids) >= self.max_length:
                if turn == 0:
                    outcome.skipped = "too_long"
                    return outcome
                break  # no room for this turn: the record ends with the previous one
            budget = self.settings.max_new_tokens
            if self.max_length is not None:
                budget = min(budget, self.max_length - len(ids))
            seed = _request_seed(self.settings.seed, item.id, turn)
            try:
                reply = self.ask(server, ids, budget, seed)
            except _Rejected as error:
                if turn > 0:  # a later, longer prompt refused: keep the turns answered
                    break
                outcome.skipped, outcome.detail = "rejected", str(error)
                return outcome
            except _NoAnswer as error:
                outcome.skipped, outcome.server_fault, outcome.detail = "failed", True, str(error)
                return outcome
            with self.tokenizer_lock:
                tokens, finish, round_trip = answer_tokens(
                    reply, self.tokenizer, self.eos_ids, self.end_of_turn
                )
            outcome.new_tokens += len(tokens)
            if round_trip is not None:
                outcome.retokenized += 1
                outcome.round_trip_failures += int(not round_trip)
            if self.max_length is not None and len(ids) + len(tokens) > self.max_length:
                tokens, finish = tokens[: self.max_length - len(ids)], "max_length"
            elif len(tokens) > budget:  # a server may overshoot its limit (llama.cpp can)
                tokens, finish = tokens[:budget], "length"
            answers.append((tokens, finish))
            prompt_ids, prompt_history = ids, list(history)
            if finish == "max_length" or turn == turns - 1:
                break
            spoken = tokens[:-1] if finish == "eos" else tokens
            with self.tokenizer_lock:
                text = self.tokenizer.decode(spoken, skip_special_tokens=True,
                                             clean_up_tokenization_spaces=False)  # fmt: skip
            history.append({"role": "assistant", "content": text})
        outcome.record = self._record(item, prompt_ids, prompt_history, answers)
        return outcome

    def _record(
        self,
        item: PromptItem,
        prompt_ids: list[int],
        prompt_history: list[Message],
        answers: list[tuple[list[int], str]],
    ) -> RolloutRecord:
        """`regenerate`'s record for one turn; for several, the last prompt (earlier answers
        marked for the loss) and its answer, with each turn's length and finish in meta."""
        tokens, finish = answers[-1]
        prompt_mask = [0] * len(prompt_ids)
        if len(answers) > 1:
            with self.tokenizer_lock:
                masked = render_prompt_masked(self.tokenizer, prompt_history)
            if masked.input_ids == prompt_ids:
                prompt_mask = masked.loss_mask
        meta: dict[str, Any] = {
            **item.meta,
            "prompt_tokens": len(prompt_ids),
            "new_tokens": len(tokens),
            "finish": finish,
        }
        if len(answers) > 1:
            meta["turns"] = len(answers)
            meta["turn_new_tokens"] = [len(t) for t, _ in answers]
            meta["turn_finish"] = [f for _, f in answers]
        return RolloutRecord(
            id=item.id,
            input_ids=prompt_ids + tokens,
            loss_mask=prompt_mask + [1] * len(tokens),
            source="regenerated",
            meta=meta,
        )

    def work(self, server: int) -> None:
        """A worker of `server`: conversations from the queue until it leaves or the run ends."""
        while True:
            job = self.dispatch.take(server)
            if job is None:
                return
            try:
                outcome = self.answer(server, job)
            except Exception as error:  # noqa: BLE001 - one bad answer must not hang the run
                log.warning("%s: prompt %r: %r", self.servers[server].url, job.item.id, error,
                            exc_info=True)  # fmt: skip
                outcome = _Outcome(job, server, skipped="error", detail=repr(error))
            self.dispatch.finish(server, outcome)


def _pending(
    prompts: Sequence[PromptItem], store: RolloutStore, rank: int, world_size: int,
    report: ServedRegenerationReport,
) -> list[PromptItem]:  # fmt: skip
    """This rank's prompts (positions i % world_size == rank) not stored yet, first of each id."""
    mine = [p for i, p in enumerate(prompts) if i % world_size == rank]
    report.assigned = len(mine)
    done = store.done_ids()
    pending: list[PromptItem] = []
    seen: set[str] = set()
    for item in mine:
        if item.id in done:
            report.already_done += 1
        elif item.id in seen:
            log.warning("prompt id %r appears twice; keeping the first", item.id)
        else:
            seen.add(item.id)
            pending.append(item)
    return pending


def regenerate_served(
    servers: str | Sequence[str],
    tokenizer: Any,
    prompts: Sequence[PromptItem],
    store: RolloutStore,
    *,
    settings: GenerationSettings | None = None,
    concurrency: int = 8,
    max_length: int | None = None,
    records_per_shard: int = 64,
    rank: int = 0,
    world_size: int = 1,
    progress: bool = True,
    on_shard: Callable[[ShardInfo], None] | None = None,
    eos_token_ids: Sequence[int] | None = None,
    retries: int = 3,
    backoff: float = 1.0,
    timeout: float = 600.0,
    max_failures: int = 3,
) -> ServedRegenerationReport:
    """Answer every prompt of this rank that ``store`` does not hold yet through `servers`
    (``URL[,URL...]`` or a list), ``concurrency`` requests at a time on each; return a report.

    The arguments shared with `regenerate` mean the same (``max_length``: prompts of that many
    tokens or more are skipped, answers stop at that many tokens in all); ``eos_token_ids``:
    the target's end-of-turn ids (default: the tokenizer's EOS). ``retries`` more tries per
    request after the first, ``backoff`` seconds before the first retry (doubling), ``timeout``
    seconds per request, ``max_failures`` conversations failed in a row before a server leaves
    the rotation. A server that does not answer at the start raises `ServerUnavailable` before
    anything is sent to the others.
    """
    settings = settings or GenerationSettings()
    if concurrency < 1 or records_per_shard < 1 or retries < 0 or max_failures < 1:
        raise ValueError(
            "concurrency, records_per_shard and max_failures must be positive, retries >= 0"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world size {world_size}")
    urls = parse_server_urls(servers)
    if not urls:
        raise ValueError("no server URL given (http://HOST:PORT[,http://HOST:PORT...])")
    if eos_token_ids is None:
        eos = getattr(tokenizer, "eos_token_id", None)
        eos_token_ids = [eos] if isinstance(eos, int) else []
    report = ServedRegenerationReport()
    pending = _pending(prompts, store, rank, world_size, report)
    if not pending:
        return report
    first = pending[0]
    segments = _turn_segments(first)
    probe_ids = (
        list(first.input_ids) if segments is None else render_prompt(tokenizer, segments[0])
    )[:PROBE_TOKENS]
    described = check_servers(urls)
    ready = [
        probe_prompt_form(server, probe_ids, tokenizer, timeout=timeout) for server in described
    ]
    for server in ready:
        report.servers[server.url] = ServerReport(
            server.url, server.api, server.model, prompt_as_text=server.prompt_as_text
        )
    log.info(
        "regenerating %d prompts through %s, %d requests at a time on each",
        len(pending), ", ".join(f"{s.url} ({s.api}: {s.model})" for s in ready), concurrency,
    )  # fmt: skip
    dispatch = _Dispatch([s.url for s in ready], max_failures)
    run = _ServedRun(
        ready, tokenizer, settings=settings, max_length=max_length, eos_ids=sorted(eos_token_ids),
        retries=retries, backoff=backoff, timeout=timeout, dispatch=dispatch, report=report,
    )  # fmt: skip
    shards = ShardBuffer(store, rank, report, on_shard)
    buffer, flush, flush_all = shards.records, shards.flush, shards.flush_all

    def count(outcome: _Outcome) -> None:
        report.new_tokens += outcome.new_tokens
        report.retokenized += outcome.retokenized
        report.retokenization_failures += outcome.round_trip_failures
        if outcome.record is not None and outcome.server is not None:
            buffer.append(outcome.record)
            report.generated += 1
            stats = report.servers[ready[outcome.server].url]
            stats.answered += 1
            stats.new_tokens += outcome.new_tokens
        elif outcome.skipped == "too_long":
            report.too_long += 1
        else:
            reason = outcome.skipped or "error"
            report.skipped[reason] = report.skipped.get(reason, 0) + 1

    feed_size = max(8, 2 * concurrency * len(ready))
    workers = [
        threading.Thread(target=run.work, args=(index,), daemon=True,
                         name=f"regenerate-served-{index}-{slot}")
        for index in range(len(ready)) for slot in range(concurrency)
    ]  # fmt: skip
    fed: set[str] = set()
    finished = False
    start = time.perf_counter()
    try:
        for worker in workers:
            worker.start()
        # claimed a batch at a time: processes sharing the store split the prompts between them
        batches = claimed_batches(
            store.claims, pending, lambda item: item.id, size=feed_size,
            what="regenerating through servers", before_wait=flush_all,
        )  # fmt: skip
        exhausted = False
        with progress_bar("regenerating", enabled=progress, unit="tok/s") as bar:
            task = bar.add_task("prompts", total=len(pending), rate=0.0)
            while True:
                while not exhausted and dispatch.any_live() and dispatch.waiting() < feed_size:
                    batch = next(batches, None)
                    if batch is None:
                        exhausted = True
                    else:
                        fed.update(item.id for item in batch)
                        dispatch.add(batch)
                try:
                    outcome = dispatch.outcomes.get(timeout=0.2)
                except queue.Empty:
                    if (
                        (exhausted or not dispatch.any_live())
                        and dispatch.idle()
                        and dispatch.outcomes.empty()
                    ):
                        break
                    continue
                count(outcome)
                report.seconds = time.perf_counter() - start
                bar.update(task, advance=1, rate=report.tokens_per_second)
                while len(buffer) >= records_per_shard:
                    flush(records_per_shard)
            flush_all()
        if not dispatch.any_live():  # what was never handed out stays unanswered
            done = store.claims.done()
            left = sum(1 for item in pending if item.id not in fed and item.id not in done)
            if left:
                report.skipped["no_server"] = report.skipped.get("no_server", 0) + left
        finished = True
    finally:
        dispatch.stop()
        for worker in workers:
            # after an error a worker may be inside a request: it is a daemon, left to end
            worker.join(timeout=None if finished else 1.0)
        # also on an error: a claim left behind would make every other writer wait for it
        store.claims.release()
    report.seconds = time.perf_counter() - start
    for index, server in enumerate(ready):
        stats = report.servers[server.url]
        stats.in_rotation = dispatch.live[index]
        stats.tokens_per_second = stats.new_tokens / report.seconds if report.seconds > 0 else 0.0
    _log_report(report, rank, world_size)
    return report


def _log_report(report: ServedRegenerationReport, rank: int, world_size: int) -> None:
    log.info(
        "served regeneration (rank %d/%d): %d answers, %d new tokens in %.1f s (%.1f tok/s), "
        "%d already done, %d too long, skipped %s, %d shards",
        rank, world_size, report.generated, report.new_tokens, report.seconds,
        report.tokens_per_second, report.already_done, report.too_long,
        report.skipped or "none", len(report.shards),
    )  # fmt: skip
    for stats in report.servers.values():
        log.info(
            "  %s (%s: %s): %d answers, %d tokens (%.1f tok/s), %d requests, %d failed%s",
            stats.url, stats.api, stats.model, stats.answered, stats.new_tokens,
            stats.tokens_per_second, stats.requests, stats.failed_requests,
            "" if stats.in_rotation else ", left the rotation",
        )  # fmt: skip
    if report.retokenization_failures:
        log.warning(
            "%d of %d text answers do not survive decode(tokenize(text)): their records hold "
            "the tokenized text, not exactly what the server wrote",
            report.retokenization_failures,
            report.retokenized,
        )

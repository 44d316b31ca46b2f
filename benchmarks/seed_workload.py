"""The seeds' workload: a planner and a LoRA generator with short fixed prefixes, with and
without lmctl, vLLM's own prefix cache on.

    .venv/bin/python benchmarks/seed_workload.py [--rounds 6] [--quick] [--json] [--block-size 32]
                                                  [--set chunk_size=128]

One vLLM engine (CPU, one process, SmolLM2-135M-Instruct in float32, see demo/models.py)
serves two kinds of request, each a chat prompt: a planner on the base model, whose fixed
part (system prompt and the chat template up to the user's turn) is about 350 tokens, and a
generator on the LoRA adapter ``civil``, whose fixed part is about 250 tokens; each is
followed by a short user question that differs from request to request. vLLM's own prefix
cache is on in every engine.

Cases, each with lmctl and without it (vLLM alone):

(a) after a restart: the first planner and generator request of an engine that starts on a
    store an earlier engine filled (the cache on local disk survives the restart).
(b) a second instance: the first planner and generator request of an engine on an empty
    local store that shares a redis-server (started here on loopback) with the first
    instance, which computed the prefixes.
(c) steady state: 4 users at once, each sending planner then generator requests (new
    questions each time) as soon as its previous answer is complete, on an engine whose own
    prefix cache already holds both prefixes: throughput (requests per second). The two
    engines (vLLM alone, lmctl on the restarted store) are alive at once, each in a process
    of its own, and take turns in short bursts (one planner and one generator request per
    user), A B, B A, ...: 4 bursts per round each (``--pipelines``), after one untimed
    burst. Each round starts a new pair of processes (which side starts and goes first
    alternates): two processes of one and the same engine can differ by 5% or more for
    their whole life, so no side rests on one process, and 6 rounds of 4 bursts cancel that
    better than 3 of 8. Throughput is all of a side's requests over all of its bursts' time; the
    bursts' own ratios are reported too, as the spread.

Without lmctl, (a) and (b) are the same thing: a fresh engine with an empty prefix cache; one
such engine per round is the baseline of both. Each round starts the three engines (vLLM
alone, lmctl after a restart, lmctl on a second instance) in a rotated order, so that the
machine's drift meets every case alike; (c) runs on vLLM alone's and the restarted engine
after (a). The engines differ only in the connector: vLLM alone runs with its hybrid KV
cache manager off, as vLLM itself runs an engine with a connector (this full-attention
model gives the manager nothing to do). Every engine is first warmed up with a prompt as
long as a planner's, new to it and unrelated to the prefixes, on the base model and on the
adapter: a fresh engine's first long steps and the adapter's load are in no timing. Every
request asks a new question, all of the same length, and no two start alike, so that no
cache can hold a block or chunk of a question. TTFT is the time from adding a request to
the engine step that returns its first token (the engine's own step loop, as a streaming
server sees it). Cached tokens are vLLM's ``num_cached_tokens`` (its own prefix cache and
lmctl's loads together).

Goals (issue 23): (a) and (b): planner and generator TTFT each at least 50% lower with lmctl
than without (ratio <= 0.5), ratios taken within each round, their median reported with
their range; (c): throughput with lmctl >= 0.97x vLLM alone's.

Every engine runs with 32-token KV blocks (``--block-size``): the finest a CPU engine takes,
and the nearest to the 16 of GPU engines, which is where this deployment runs. lmctl caches
a prefix down to the engine's block, so the block decides how much of a fixed prefix can be
served: at 32, 320 of the planner's 350 tokens and 224 of the generator's 250; at vLLM's CPU
default of 128 (``--block-size 128``), 256 and 128, and the generator's goal is out of reach
of any cache that serves whole blocks. The store's chunk size and the engine's block size are
read from the running connector and engine, not assumed: ``--set chunk_size=128`` (any
``kv_connector_extra_config`` setting) changes them, and the expected cached tokens follow.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # keep the output readable
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is the table or the JSON
import demo.engine  # noqa: E402,F401  (sets vLLM's environment before it is imported)
from demo.engine import Engine  # noqa: E402
from demo.models import make_lora, smollm2  # noqa: E402
from testsupport.redis import Server, secret_file  # noqa: E402

PLANNER_TOKENS = 350    # the planner's fixed prefix, about
GENERATOR_TOKENS = 250  # the generator's fixed prefix, about
ADAPTER = "civil"
MODES = ("vllm", "restart", "second")  # vLLM alone; lmctl after a restart; lmctl on a second instance

PLANNER_RULES = [
    "You are the planner of a legal help desk for tenants and landlords.",
    "Read the user's question and write a numbered plan of at most five steps.",
    "Each step names one source to consult: the lease, the civil code, the housing act, or case law.",
    "Never answer the question yourself; the generator writes the answer from your plan.",
    "If the question is about money, the first step checks the amounts stated in the lease.",
    "If the question is about notice, a step checks how the notice was delivered and when.",
    "If the question is about repairs, a step asks who caused the damage and when it was reported.",
    "If the question is about a deposit, a step checks the account the deposit is held in.",
    "If the question is about ending the lease, a step checks the term and the renewal clause.",
    "If the question mentions a court, a step checks the deadlines for an appeal.",
    "If the question names a city, a step checks local rules on rent and eviction in that city.",
    "Mark any step that needs a document the user has not given with the word MISSING.",
    "Keep each step under twenty words and write in plain English.",
    "Do not give advice on criminal matters; plan a referral to a lawyer instead.",
    "Do not repeat the question in the plan.",
    "End the plan with one line that says which step matters most and why.",
    "The plan is read by a program, so use no markdown, no headings and no bullet symbols.",
    "Number the steps 1 to 5 and start each with a verb.",
    "When two sources disagree, plan a step that compares them and says which one prevails.",
    "When the question is unclear, the first step asks the user one short question back.",
]
GENERATOR_RULES = [
    "You write the answer for a tenant or landlord from a plan made by the planner.",
    "Write in plain civil-law language that a person without legal training understands.",
    "Follow the plan's steps in order and cite the source each step names.",
    "Use short sentences, at most three paragraphs, and no lists.",
    "Say clearly what the person may do, what they must do, and what they must not do.",
    "Where the plan marks a step MISSING, say which document would settle the question.",
    "Never invent an article number, a case name or an amount of money.",
    "If the law differs between cities, say so and name the rule that usually applies.",
    "End with one sentence on when to see a lawyer.",
    "Do not greet the reader and do not sign the answer.",
    "Keep the tone calm and neutral toward both parties.",
    "Prefer the words tenant, landlord, lease, deposit and notice over their legal synonyms.",
    "Write amounts in euros and dates as day, month and year.",
    "When a deadline applies, state it first.",
    "Do not repeat the plan; the reader never sees it.",
    "If the plan is empty or makes no sense, answer that the question needs a person to review it.",
    "Quote at most one short sentence of the lease, and only when a step names the lease.",
    "Write for a reader on a phone: the whole answer fits on one screen.",
]
NAMES = ["Anna", "Bruno", "Chloe", "Dmitri", "Elif", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kofi", "Lena",
         "Marek", "Nadia", "Oscar", "Priya", "Quentin", "Rosa", "Samir", "Tove"]
CITIES = ["Lyon", "Porto", "Ghent", "Bergen", "Turin", "Graz", "Cork", "Utrecht", "Malmo", "Brno", "Split", "Basel",
          "Tartu", "Bilbao", "Aarhus", "Krakow"]
TOPICS = ["the deposit was not returned", "the heating has been broken for weeks", "rent went up by {n} percent",
          "notice to leave came by email", "the landlord entered without notice", "a flood damaged the floor",
          "the lease ends in {n} days", "a neighbour is too loud at night", "the agent asks for {n} euros in fees",
          "the lease forbids pets"]
ASKS = ["What can they do?", "Who pays?", "Is that allowed?", "What are the deadlines?", "Can they refuse?"]
#: the question's tokens in every prompt (the user's turn and the chat template's tail): equal
#: lengths, so that no case gets shorter prompts than another
QUESTION_TOKENS = 31
#: no two questions of a run share their first this many tokens, so that no cache, vLLM's or
#: lmctl's, can hit a block or chunk holding the start of a question another request asked
#: (a block boundary falls 4 or more tokens into the question at 16- and 32-token blocks, and
#: two questions that differ in their first 4 tokens differ in any longer head)
UNIQUE_HEAD = 4


def head_in_block(fixed: int, block: int) -> int:
    """How many of a question's first tokens share a ``block``-token block with the last of a
    ``fixed``-token part (0: the question starts a block). Under ``UNIQUE_HEAD`` but over 0,
    two questions could share that block, and a cache could serve it."""
    return -fixed % block


def question(seed: int) -> str:
    """A short user question (about 25 tokens), opening with a case number: its digits make
    questions start differently (a run asks hundreds of them)."""
    rng = random.Random(seed)
    topic = rng.choice(TOPICS).format(n=rng.randrange(2, 60))
    return f"{rng.randrange(100000, 1000000)}. {rng.choice(NAMES)} in {rng.choice(CITIES)}: {topic}. {rng.choice(ASKS)}"


class Questions:
    """Prompts of one fixed prefix with new questions: each prompt is the fixed part and
    exactly ``QUESTION_TOKENS`` more, and its first ``UNIQUE_HEAD`` question tokens were
    in no earlier prompt of the run (the head is shared by every ``Questions`` of a run)."""

    def __init__(self, tok: Any, system: str, fixed: int, seen: set[tuple[int, ...]], first_seed: int) -> None:
        self.tok, self.system, self.fixed, self.seen, self.seed = tok, system, fixed, seen, first_seed

    def next(self) -> list[int]:
        for _ in range(20000):
            self.seed += 1
            ids = prompt_ids(self.tok, self.system, question(self.seed))
            head = tuple(ids[self.fixed:self.fixed + UNIQUE_HEAD])
            if len(ids) == self.fixed + QUESTION_TOKENS and head not in self.seen:
                self.seen.add(head)
                return ids
        raise RuntimeError("no new question of the right length; change QUESTION_TOKENS")


def fixed_prefix(tok: Any, rules: list[str], target: int) -> tuple[str, int]:
    """The longest system prompt made of the words of ``rules`` (in order) whose fixed part,
    the chat prompt's tokens shared by every question, is at most ``target`` tokens; and
    that length."""
    words = " ".join(rules).split()
    best = ("", 0)
    for n in range(1, len(words) + 1):
        system = " ".join(words[:n])
        shared = _shared_len(prompt_ids(tok, system, "Why?"), prompt_ids(tok, system, "How?"))
        if shared > target:
            break
        best = (system, shared)
    return best


def prompt_ids(tok: Any, system: str, user: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": user}],
                                  tokenize=True, add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # a BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def _shared_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@dataclass
class Request:
    kind: str            # "planner" or "generator"
    tokens: list[int]
    lora: Any            # a LoRARequest or None
    max_tokens: int


@dataclass
class Done:
    kind: str
    ttft_s: float
    e2e_s: float
    cached_tokens: int
    prompt_tokens: int
    output_tokens: int


def run(eng: Engine, users: list[list[Request]]) -> tuple[list[Done], float]:
    """Run each user's requests in order, one at a time per user, all users at once (a new
    request as soon as the user's previous one finished), through the engine's own step
    loop. Returns every request's figures and the wall time of the whole."""
    from vllm import SamplingParams

    core = eng.llm.llm_engine
    queues = [list(u) for u in users]
    live: dict[str, tuple[int, Request, float]] = {}   # request id -> (user, request, added at)
    first: dict[str, float] = {}
    done: list[Done] = []
    ids = iter(range(1 << 62))

    def submit(user: int) -> None:
        if not queues[user]:
            return
        r = queues[user].pop(0)
        rid = f"seed-{next(ids)}-{time.monotonic_ns()}"
        params = SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True, detokenize=False)
        live[rid] = (user, r, time.perf_counter())
        core.add_request(rid, {"prompt_token_ids": r.tokens}, params, lora_request=r.lora)

    t0 = time.perf_counter()
    for u in range(len(queues)):
        submit(u)
    while live:
        outs = core.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id not in live:
                continue
            user, r, added = live[out.request_id]
            if out.request_id not in first and out.outputs and len(out.outputs[0].token_ids) > 0:
                first[out.request_id] = now
            if out.finished:
                del live[out.request_id]
                done.append(Done(r.kind, first.get(out.request_id, now) - added, now - added,
                                 int(out.num_cached_tokens or 0), len(r.tokens), len(out.outputs[0].token_ids)))
                submit(user)
    return done, time.perf_counter() - t0


def make_engine(model: Path, store: Path | None, connector: dict[str, Any] | None, block_size: int,
                max_len: int) -> Engine:
    """An engine of this benchmark: lmctl's connector with ``connector``'s settings on
    ``store``, or vLLM alone when ``store`` is None."""
    # vLLM turns its hybrid KV cache manager off whenever a connector is configured; off in
    # vLLM alone too, so that the connector is the engines' only difference
    return Engine(model, store, max_model_len=max_len, lora=True, prefix_caching=True,
                  connector=None if store is None else connector, disable_hybrid_kv_cache_manager=True,
                  block_size=block_size)


def _steady_engine(conn: Any, model: str, adapter: str, store: str | None, connector: dict[str, Any] | None,
                   block_size: int, max_len: int) -> None:
    """One engine of the steady state, in a process of its own: runs the batches of users
    it is sent (requests as plain tuples) and sends back their figures, until it gets None."""
    from dataclasses import asdict

    from vllm.lora.request import LoRARequest

    civil = LoRARequest(ADAPTER, 1, adapter)
    eng = make_engine(Path(model), None if store is None else Path(store), connector, block_size, max_len)
    try:
        conn.send("ready")
        while (batch := conn.recv()) is not None:
            users = [[Request(k, toks, civil if lora else None, n) for k, toks, lora, n in u] for u in batch]
            done, wall = run(eng, users)
            conn.send(([asdict(d) for d in done], wall))
    finally:
        eng.close()


def steady_state(sides: dict[str, tuple[Path | None, dict[str, Any] | None]], model: str, adapter: str,
                 block_size: int, max_len: int, warm: list[list[Request]], bursts: int,
                 burst: Callable[[], list[list[Request]]], untimed: int = 1) -> dict[str, list[dict[str, float]]]:
    """(c): one engine per side (store and connector settings; None: vLLM alone), each in a
    process of its own and all alive at once, started one after the other; each first runs
    ``warm`` (one batch after another) and ``untimed`` bursts, untimed, then the sides take turns running a new
    ``burst()`` each, ``bursts`` times, in alternating order (A B, B A, ...), so that the
    machine's drift from one minute to the next meets both alike. Returns each side's
    figures per burst."""
    import multiprocessing

    def plain(users: list[list[Request]]) -> list[list[tuple[str, list[int], bool, int]]]:
        return [[(r.kind, r.tokens, r.lora is not None, r.max_tokens) for r in u] for u in users]

    ctx = multiprocessing.get_context("spawn")
    procs: dict[str, tuple[Any, Any]] = {}

    def ask(side: str, batch: Any, timeout: float = 900) -> Any:
        conn = procs[side][1]
        conn.send(batch)
        if not conn.poll(timeout):
            raise RuntimeError(f"the {side} engine of the steady state did not answer in {timeout:.0f} s")
        return conn.recv()

    out: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    try:
        for side, (store, connector) in sides.items():
            here, there = ctx.Pipe()
            proc = ctx.Process(target=_steady_engine, daemon=True,
                               args=(there, model, adapter, None if store is None else str(store), connector,
                                     block_size, max_len))
            proc.start()
            procs[side] = (proc, here)
            try:  # one start-up at a time: they would fight for the cores
                if not here.poll(900) or here.recv() != "ready":
                    raise RuntimeError(f"the {side} engine of the steady state did not start")
            except EOFError:
                proc.join(5)
                raise RuntimeError(f"the {side} engine of the steady state failed to start "
                                   f"(exit code {proc.exitcode})") from None
            for batch in warm:
                ask(side, plain([batch]))
            for _ in range(untimed):  # an engine's first bursts run slower, with or without lmctl
                ask(side, plain(burst()))
        names = list(sides)
        for k in range(bursts):
            for side in (names if k % 2 == 0 else names[::-1]):
                got, wall = ask(side, plain(burst()))
                done = [Done(**d) for d in got]
                out[side].append({"req_per_s": len(done) / wall,
                                  "output_tok_per_s": sum(d.output_tokens for d in done) / wall,
                                  "wall_s": wall, "requests": len(done),
                                  "ttft_median_s": statistics.median(d.ttft_s for d in done),
                                  "cached_fraction": sum(d.cached_tokens for d in done)
                                  / sum(d.prompt_tokens for d in done)})
    finally:
        for _proc, conn in procs.values():
            try:
                conn.send(None)
            except OSError:
                pass
        for proc, _ in procs.values():
            proc.join(120)
            if proc.is_alive():
                proc.kill()
                proc.join(10)  # the next round's engine opens the same store
    return out


def granularity(eng: Engine) -> dict[str, Any]:
    """The engine's block size and, with the connector on, the store's chunk size, as the
    running engine and connector have them."""
    out: dict[str, Any] = {"block_size": int(eng.llm.llm_engine.vllm_config.cache_config.block_size)}
    if eng.store_path is not None:
        from engine_hook.vllm import live_connectors

        c = next(c for c in live_connectors() if c.connector_scheduler is not None)
        ctx = c.context
        out["block_size"] = int(getattr(ctx, "block_size", out["block_size"]))
        out["chunk_size"] = int(ctx.kv_format.chunk_size)
    return out


def connector_stats() -> dict[str, Any]:
    from engine_hook.vllm import live_connectors

    total: dict[str, Any] = {}
    for c in live_connectors():
        for k, v in c.stats().items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                total[k] = round(total.get(k, 0) + v, 4)
    return total


def summary(xs: list[float]) -> dict[str, Any]:
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4),
            "all": [round(x, 4) for x in xs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=None,
                    help="rounds of the three engines and of the steady state's pair of engines "
                         "(default 6; --quick 1)")
    ap.add_argument("--users", type=int, default=4, help="concurrent users in the steady state")
    ap.add_argument("--pipelines", type=int, default=None,
                    help="steady-state bursts per round and side; in each, every user sends a planner "
                         "then a generator request (default 4; --quick 1)")
    ap.add_argument("--untimed-bursts", type=int, default=1, metavar="N",
                    help="bursts each engine of the steady state runs before the timed ones (default 1)")
    ap.add_argument("--planner-out", type=int, default=16, help="tokens the planner generates")
    ap.add_argument("--generator-out", type=int, default=32, help="tokens the generator generates")
    ap.add_argument("--quick", action="store_true", help="one round, a short steady state: a smoke test")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a kv_connector_extra_config setting for the lmctl engines (JSON value, or a string)")
    ap.add_argument("--block-size", type=int, default=32, metavar="TOKENS",
                    help="the engines' KV block size (default 32, the finest a CPU engine takes; "
                         "GPU engines use 16, vLLM's CPU default is 128)")
    ap.add_argument("--steady-remote-write", choices=("always", "evict", "never"), default=None,
                    help="the remote_write setting of the lmctl engine of the steady state (c) alone "
                         "(default: the connector's default, always)")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object")
    ap.add_argument("--work", default=str(ROOT / ".cache"), help="folder of the model and adapter")
    args = ap.parse_args()
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 6)
    pipelines = args.pipelines if args.pipelines is not None else (1 if args.quick else 4)
    if rounds < 1 or args.users < 1 or pipelines < 1 or args.untimed_bursts < 0:
        ap.error("--rounds, --users and --pipelines must be at least 1, --untimed-bursts at least 0")
    if args.block_size < 32 or args.block_size & (args.block_size - 1):
        ap.error(f"--block-size {args.block_size}: a CPU engine takes a power of two from 32 up (32, 64, 128)")
    extra: dict[str, Any] = {}
    for item in args.set:
        key, eq, value = item.partition("=")
        if not eq or not key:
            ap.error(f"--set {item!r}: write KEY=VALUE, e.g. chunk_size=128")
        try:
            extra[key] = json.loads(value)
        except ValueError:
            extra[key] = value
    from engine_hook.config import ConnectorSettings
    from store import StoreError

    if "store_path" in extra or any(k.startswith("remote_") for k in extra):
        ap.error("--set: the benchmark chooses store_path and the remote_* settings itself")
    try:  # refused here in one line, not by the engine after a minute of start-up
        ConnectorSettings.parse({**extra, "store_path": str(ROOT)})
    except StoreError as exc:
        ap.error(f"--set: {exc}")

    work = Path(args.work)
    model = smollm2(work / "models" / "smollm2-135m-instruct")
    adapter = make_lora(model, work / "adapters" / ADAPTER, seed=11)  # the demo's civil adapter
    from transformers import AutoTokenizer
    from vllm.lora.request import LoRARequest

    tok = AutoTokenizer.from_pretrained(model)
    planner_sys, planner_fixed = fixed_prefix(tok, PLANNER_RULES, PLANNER_TOKENS)
    generator_sys, generator_fixed = fixed_prefix(tok, GENERATOR_RULES, GENERATOR_TOKENS)
    for fixed in (planner_fixed, generator_fixed):  # chunk boundaries are block boundaries too
        if 0 < (head := head_in_block(fixed, args.block_size)) < UNIQUE_HEAD:
            sys.exit(f"seed_workload.py: error: a {args.block_size}-token block ends {head} "
                     f"token(s) into the question after a fixed part of {fixed} tokens: questions could share "
                     f"that block (they differ only from their first {UNIQUE_HEAD} tokens on)")
    civil = LoRARequest(ADAPTER, 1, str(adapter))
    seen: set[tuple[int, ...]] = set()
    planners = Questions(tok, planner_sys, planner_fixed, seen, 1000)
    generators = Questions(tok, generator_sys, generator_fixed, seen, 1 << 20)

    def planner(max_tokens: int) -> Request:
        return Request("planner", planners.next(), None, max_tokens)

    def generator(max_tokens: int) -> Request:
        return Request("generator", generators.next(), civil, max_tokens)

    warm_ups = iter(range(1 << 30))

    def warm_prompt() -> list[Request]:
        """A prompt unrelated to the prefixes and new to every engine, as long as a
        planner's, on the base model and on the adapter: the engine's first long steps and
        the adapter's load are in no timing (a fresh engine's first large step is slower,
        with or without lmctl), and nothing is loaded from the store before the timed
        requests."""
        n = next(warm_ups)
        notes = " ".join(f"Note {n}.{i}: the weather in {CITIES[(n + i) % len(CITIES)]} was mild." for i in range(40))
        ids = prompt_ids(tok, f"Summarise these notes ({n}).", notes)[:planner_fixed + QUESTION_TOKENS]
        return [Request("warm", ids, None, 2), Request("warm", ids, civil, 2)]

    def warm_up(eng: Engine) -> None:
        run(eng, [warm_prompt()])

    tmp = Path(tempfile.mkdtemp(prefix="lmctl-seed-", dir=work))
    redis = Server(tmp / "redis")
    result: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct float32", "adapter": ADAPTER, "rounds": rounds, "quick": args.quick,
        "users": args.users, "pipelines_per_user": pipelines,
        "prefix_tokens": {"planner": planner_fixed, "generator": generator_fixed},
        "prompt_tokens": {"planner": planner_fixed + QUESTION_TOKENS, "generator": generator_fixed + QUESTION_TOKENS},
        "connector_settings": extra, "steady_remote_write": args.steady_remote_write,
        "untimed_bursts": args.untimed_bursts,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    t_start = time.perf_counter()
    try:
        redis.wait(redis.client)
        remote = {"remote_url": redis.url, "remote_key_prefix": "seed",
                  "remote_secret_file": str(secret_file(tmp)), **extra}
        max_len = 1024

        def engine(mode: str, r: int) -> Engine:
            store = {"vllm": None, "restart": tmp / "instance-1", "second": tmp / f"instance-2-round-{r}"}[mode]
            return make_engine(model, store, remote, args.block_size, max_len)

        # the first instance computes both prefixes once: its local store and Redis hold them
        eng = engine("restart", -1)
        try:
            warm_up(eng)
            run(eng, [[planner(1), generator(1)]])
            eng.flush()
            result["engine"] = granularity(eng)
        finally:
            eng.close()

        first: dict[str, dict[str, list[Done]]] = {m: {"planner": [], "generator": []} for m in MODES}
        per_round: list[dict[str, Any]] = []
        for r in range(rounds):
            order = MODES[r % 3:] + MODES[:r % 3]
            this: dict[str, Any] = {"order": list(order)}
            for mode in order:
                # new questions for each engine (the same lengths): no store holds a chunk of them
                firsts = [planner(args.planner_out), generator(args.generator_out)]
                eng = engine(mode, r)
                try:
                    warm_up(eng)
                    got, _ = run(eng, [firsts])  # one at a time: the planner, then the generator
                    for d in got:
                        first[mode][d.kind].append(d)
                    this[mode] = {d.kind: {"ttft_s": round(d.ttft_s, 4), "cached_tokens": d.cached_tokens}
                                  for d in got}
                    if mode != "vllm":
                        eng.flush()
                        this[mode]["connector"] = connector_stats()
                finally:
                    eng.close()
            per_round.append(this)

        cases: dict[str, Any] = {}
        for case, mode in (("restart", "restart"), ("second_instance", "second")):
            cases[case] = {}
            for kind in ("planner", "generator"):
                off, on = first["vllm"][kind], first[mode][kind]
                ratios = [b.ttft_s / a.ttft_s for a, b in zip(off, on, strict=True)]
                cases[case][kind] = {
                    "vllm": {"ttft_s": summary([d.ttft_s for d in off]),
                             "cached_tokens": int(statistics.median(d.cached_tokens for d in off))},
                    "lmctl": {"ttft_s": summary([d.ttft_s for d in on]),
                              "cached_tokens": int(statistics.median(d.cached_tokens for d in on)),
                              "prompt_tokens": int(statistics.median(d.prompt_tokens for d in on))},
                    "ratio": summary(ratios), "goal": "<= 0.5",
                    # a gain without a token from lmctl is the machine's noise, not lmctl's
                    "met": statistics.median(ratios) <= 0.5 and statistics.median(d.cached_tokens for d in on)
                    > statistics.median(d.cached_tokens for d in off)}
        # (c): two engines alive at once, each in a process of its own (vLLM keeps one KV
        # connector per process), taking turns in short bursts: A B, B A, ...
        def burst() -> list[list[Request]]:
            return [[planner(args.planner_out), generator(args.generator_out)] for _ in range(args.users)]

        steady_remote = remote if args.steady_remote_write is None else {
            **remote, "remote_write": args.steady_remote_write}
        # a new pair of engine processes in each round: two processes of the same engine differ
        # by several percent from one start to the next (where their memory lands), more than
        # the goal's 3%, so no side's figure may rest on one process
        sides: dict[str, tuple[Path | None, dict[str, Any] | None]] = {
            "vllm": (None, None), "restart": (tmp / "instance-1", steady_remote)}
        steady: dict[str, list[dict[str, float]]] = {n: [] for n in sides}
        for r in range(rounds):
            names = list(sides) if r % 2 == 0 else list(sides)[::-1]
            got = steady_state({n: sides[n] for n in names}, str(model), str(adapter), args.block_size,
                               max_len, [warm_prompt(), [planner(1), generator(1)]], pipelines, burst,
                               args.untimed_bursts)
            for n in names:
                steady[n].extend(got[n])
        result["steady_bursts"] = rounds * pipelines
        tp = [b["req_per_s"] / a["req_per_s"] for a, b in zip(steady["vllm"], steady["restart"], strict=True)]
        cases["steady"] = {
            mode: {k: summary([s[k] for s in steady[mode]]) for k in steady[mode][0]} for mode in steady}
        cases["steady"]["lmctl"] = cases["steady"].pop("restart")
        def rate(mode: str) -> float:  # requests per second over all of a side's bursts
            return sum(b["requests"] for b in steady[mode]) / sum(b["wall_s"] for b in steady[mode])

        through = rate("restart") / rate("vllm")
        cases["steady"].update({"ratio": summary(tp), "throughput_ratio": round(through, 4), "goal": ">= 0.97",
                                "met": through >= 0.97})
        result["cases"] = cases
        result["per_round"] = per_round
    finally:
        redis.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["wall_s"] = round(time.perf_counter() - t_start, 1)

    if args.json:
        print(json.dumps(result))
        return
    print(table(result))


def table(res: dict[str, Any]) -> str:
    """The short table of (a), (b) and (c) that the README's demo section shows."""
    e, p, n = res["engine"], res["prefix_tokens"], res["prompt_tokens"]
    lines = [f"seed workload: planner on the base model (fixed prefix {p['planner']} of {n['planner']} tokens), "
             f"generator on LoRA {res['adapter']} ({p['generator']} of {n['generator']})",
             f"vLLM prefix cache on; engine block {e['block_size']} tokens, lmctl chunk {e['chunk_size']} tokens; "
             f"{res['rounds']} round(s), load average {res['loadavg_start'][0]:.1f} -> {res['loadavg_end'][0]:.1f}",
             "TTFT median [min-max] (cached tokens)",
             f"{'':24}{'':10} {'vLLM alone':>24} {'with lmctl':>24}   {'lmctl/vLLM':>10}  goal"]
    for case, name in (("restart", "(a) after a restart"), ("second_instance", "(b) second instance")):
        for i, kind in enumerate(("planner", "generator")):
            c = res["cases"][case][kind]

            def cell(side: dict[str, Any]) -> str:
                t = side["ttft_s"]
                return f"{t['median']:.2f}s [{t['min']:.2f}-{t['max']:.2f}] ({side['cached_tokens']})"

            verdict = "met" if c["met"] else "NOT met"
            if c["lmctl"]["cached_tokens"] <= c["vllm"]["cached_tokens"]:
                verdict += " (lmctl cached nothing more)"
            lines.append(f"{name if i == 0 else '':24}{kind:10} {cell(c['vllm']):>24} {cell(c['lmctl']):>24}   "
                         f"{c['ratio']['median']:10.2f}  <= 0.50 {verdict}")
    s = res["cases"]["steady"]
    def rate(side: dict[str, Any]) -> str:
        t = side["req_per_s"]
        return f"{t['median']:.2f} [{t['min']:.2f}-{t['max']:.2f}]"

    r = s["ratio"]
    lines.append(f"{'(c) ' + str(res['users']) + ' users, steady':24}{'req/s':10} "
                 f"{rate(s['vllm']):>24} {rate(s['lmctl']):>24}   "
                 f"{s['throughput_ratio']:10.4f}  >= 0.97 {'met' if s['met'] else 'NOT met'} "
                 f"(bursts: median {r['median']:.2f}, {r['min']:.2f}-{r['max']:.2f})")
    return "\n".join(lines)


if __name__ == "__main__":
    from store import StoreError

    try:
        main()
    except StoreError as exc:  # e.g. a chunk_size that is no multiple of the engine's block size
        sys.exit(f"seed_workload.py: error: {exc}")

"""``lmctl lookup``: how much of a document is cached, why it misses, and (``--router``) what a router's
KV index says of it."""

from collections.abc import Callable
from typing import Annotated, Any

import typer

from ..selectors import with_selectors
from ..terminal import CommandError, ExitStatus, Terminal
from .base import Show, chunk_id, request


@with_selectors
def lookup(ctx: typer.Context, sel: dict[str, Any], explain: Annotated[bool, typer.Option(
        "--explain", help="say why the first missing chunk misses (a reason code and a sentence)")] = False,
           min_hit: Annotated[float | None, typer.Option(
               "--min-hit", help="exit 1 (with one line) unless at least this fraction of the document's tokens "
                                 "is cached, 0-1 (e.g. 0.9)")] = None,
           router: Annotated[str | None, typer.Option(
               metavar="URL", help="also ask a router's KV index (Dynamo's KV indexer, POST URL/query) which "
                                   "instances hold the document, how much of it and in which tier")] = None,
           router_model: Annotated[str | None, typer.Option(
               metavar="NAME", help="with --router: the model name the router knows the engines by "
                                    "(default: the document's model id)")] = None) -> None:
    """How much of a document is cached: hit tokens, chunks per tier, first miss (--explain: why).

    \b
    Examples:
      lmctl lookup --model smollm2 --messages chat.json --explain
      lmctl lookup --adapter civil --file contract.txt
      lmctl -q lookup --file contract.txt --min-hit 0.9 || lmctl warm --file contract.txt
      lmctl --json lookup --key 48c937a7583e21f2
      lmctl lookup --file contract.txt --router http://router:8090 --router-model smollm2
    """
    term = Terminal.of(ctx)
    if min_hit is not None and not 0 <= min_hit <= 1:
        raise typer.Exit(term.report("usage", f"--min-hit must be a fraction between 0 and 1 (0.9: 90%), not "
                                              f"{min_hit:g}"))

    def enough(r: dict[str, Any]) -> bool:
        if min_hit is None:
            return True
        total = r.get("total_tokens") or 0
        got = r["hit_tokens"] / total if total else 0.0
        if got >= min_hit:
            return True
        if not term.json:  # JSON says it all: the result, and the exit status
            print(f"lmctl: {100 * got:.1f}% of the document is cached ({r['hit_tokens']} of {total} tokens), "
                  f"below --min-hit {min_hit:g}", file=term.err)
        return False

    # a gate under --quiet: the exit status is the answer, the line below says why it failed
    show: Show = (lambda t, r: None) if term.quiet and min_hit is not None else _show_lookup
    if router is not None or router_model is not None:
        _lookup_router(term, sel, explain, router, router_model, show, enough)
        return
    request(ctx, "lookup", {**sel, "explain": True} if explain else sel, show, ok=enough)


def _lookup_router(term: Terminal, sel: dict[str, Any], explain: bool, url: str | None,
                   model: str | None, show: Show, ok: Callable[[dict[str, Any]], bool]) -> None:
    """``lookup --router``: this store's answer, then the router's, per instance."""
    from ..router import ask, query_url

    def body() -> None:
        if url is None:
            raise CommandError("usage", "--router-model needs --router URL (the router index to ask)")
        query_url(url)  # a bad URL is a usage error before the daemon is asked
        r = term.call("lookup", {**sel, "token_ids": True, **({"explain": True} if explain else {})})
        tokens = r.pop("token_ids", None)
        if not tokens:
            raise CommandError("usage", "--router needs a document (--text, --file, --tokens or --messages): the "
                                        "router is asked by its tokens")
        ns = r.get("namespace") or {}
        name = model or ns.get("model")
        if not name:
            raise CommandError("usage", "the document's model is not known here: pass --router-model NAME")
        adapter = ns.get("adapter")
        lora = None if not adapter else str(adapter).split("@", 1)[0]
        r["router"] = {"url": url, "model_name": name, "lora_name": lora,
                       "instances": ask(url, [int(t) for t in tokens], name, lora)}
        term.emit(r, show)
        if not ok(r):
            raise typer.Exit(ExitStatus.ERROR)

    term.run(body)


def _show_lookup(term: Terminal, r: dict[str, Any]) -> None:
    from rich.text import Text

    n, size, total = len(r["chunks"]), r.get("chunk_size"), r.get("total_tokens") or 0
    part = r.get("partial")
    short = n == 0 and total > 0 and not part  # a document shorter than one chunk, none of it stored
    if short:
        term.say(f"the document's {total} token(s) are less than one chunk of {size}: nothing of it is stored "
                 "(an engine stores a request's partial last chunk in whole blocks; none of these)")
    elif total:
        pct = 100 * r["hit_tokens"] / total
        tail = total - n * size if size else 0
        held = (f", and the first {part['tokens']} tokens of chunk {part['chunk']} ({part['tier']}, "
                + ("a request's tail record" if part["via"] == "tail" else
                   f"the first blocks of a record of {part['record_tokens']} tokens") + ")"
                if part else "")
        term.say(f"{r['hit_tokens']} of {total} tokens cached ({pct:.0f}%), {r['hit_chunks']} of {n} full chunks"
                 + held
                 + (f"; first miss at token {r['first_miss']}" if r.get("first_miss") is not None
                    and r["hit_chunks"] < n else "")
                 + (f"; the last {tail} token(s) are less than a chunk" if tail > 0 and not part else ""))
    ns = r.get("namespace")
    if ns:
        fp = ns.get("model_fingerprint")
        term.say(f"model {ns.get('model')}  adapter {ns.get('adapter') or '(base)'}"
                 + (f"  fingerprint {fp[:12]}" if fp else "") + ("  (salted)" if ns.get("salted") else ""))
    if n:
        rows = [[str(x["index"]), chunk_id(x["key"]), x["tier"] or Text("miss", style="red")] for x in r["chunks"]]
        term.table(None, ["chunk", "chunk hash", "tier"], rows)
    if "explain" in r and not short:
        why = r["explain"]
        if why is None:
            term.say("nothing misses: every full chunk is cached")
        else:
            term.say(f"why: {why['reason']}: {why['message']}")
    if "router" in r:
        _show_router(term, r["router"], total)


def _show_router(term: Terminal, routed: dict[str, Any], total: int) -> None:
    insts = routed["instances"]
    who = routed["model_name"] + (f", adapter {routed['lora_name']}" if routed.get("lora_name") else "")
    if not insts:
        term.say(f"router {routed['url']} ({who}): no instance holds any of it")
        return
    term.say(f"router {routed['url']} ({who}): {len(insts)} instance(s) hold some of it")
    rows = [[wid, str(v["longest_matched"]), f"{100 * v['longest_matched'] / total:.0f}%" if total else "-",
             str(v["gpu"]), str(v["cpu"]), str(v["disk"])]
            for wid, v in sorted(insts.items(), key=lambda kv: -kv[1]["longest_matched"])]
    term.table(None, ["instance", "tokens", "of doc", "gpu", "cpu", "disk"], rows,
               {"tokens", "of doc", "gpu", "cpu", "disk"})

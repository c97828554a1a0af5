"""How `genq status` shows a status dict: a readable rich table, for people, not scripts."""

from __future__ import annotations

import time
from typing import Any


def human_duration(seconds: float | None) -> str:
    """96100 -> '1d 2h 41m'; what a person reads at a glance."""
    if seconds is None:
        return "—"
    d, s = divmod(int(round(seconds)), 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d {h}h {m}m"
    if h:
        return f"{h}h {m}m"
    return f"{m}m {s}s" if m else f"{s}s"


def _server_table(status: dict) -> Any:
    from rich.table import Table

    table = Table(title="servers (run+ahead: requests at the server + tasks claimed for the "
                        "next free slots; other: leases being committed or of a dead consumer)",
                  title_justify="left", expand=False, padding=(0, 0))
    # The server is what a person acts on: short (no scheme), folded rather than dropped on
    # a narrow terminal (80 columns).
    table.add_column("server", overflow="fold", min_width=12)
    for col in (" req/s", " tok/s", " run+ahead/cap", " other", " srv run/wait", " KV",
                " seen"):
        table.add_column(col, justify="right", no_wrap=True)
    for s in status["servers"]:
        load = s.get("load") or {}
        run_wait = f"{load.get('num_reqs', '?')}/{load.get('num_waiting_reqs', '?')}"
        usage = load.get("token_usage")
        seen = s.get("last_seen_s")
        running, ahead = s.get("running") or 0, s.get("claimed_ahead") or 0
        other = max(0, s["inflight"] - running - ahead)  # committing, or a dead consumer's
        table.add_row(s["server"].split("://", 1)[-1], f"{s['req_per_s']:.2f}",
                      f"{s['tok_per_s']:,.0f}", f"{running}+{ahead}/{s['capacity'] or '?'}",
                      str(other), run_wait if load else "—",
                      f"{usage:.0%}" if usage is not None else "—",
                      f"{seen:.0f}s" if seen is not None else "gone")
    return table


def history_lines(status: dict) -> list[str]:
    """One line per parameter version: what changed, the redo asked for, when (UTC)."""
    out = []
    for h in status.get("params_history") or []:
        changes = h.get("changes") or {}
        # Version 1 records its values; later versions record [old, new] pairs.
        what = " ".join(
            f"{key} {value[0]}->{value[1]}" if isinstance(value, list) and len(value) == 2
            else f"{key}={value}" for key, value in changes.items())
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(h.get("at", 0)))
        extra = f" (redo {h['redo']}, {h['inflight']} in-flight)" if h.get("version", 1) > 1 else ""
        if c := (status.get("continued") or {}).get(str(h.get("version"))):
            extra += (f"; {c['continued']:,} continued, {c['decode_tokens_saved']:,} decode "
                      "tokens saved")
        if c := (status.get("schema") or {}).get(str(h.get("version"))):
            extra += (f"; schema: {c['invalid']:,} answers invalid, {c['failed']:,} prompts "
                      f"failed, {c.get('cut', 0):,} answers cut at max_tokens (not JSON)")
            if c.get("unkept"):
                extra += (f", {c['unkept']:,} answers not kept in Redis (past its bound; "
                          "the shards' failed lines hold them)")
        out.append(f"v{h.get('version')} {when}Z  {what}{extra}")
    return out


def render_table(status: dict) -> Any:
    """A rich renderable for `genq status`: progress, rates, finish mix, lengths, servers."""
    from rich.console import Group
    from rich.text import Text

    total, done = status["total"], status["done"]
    frac = done / total if total else 0.0
    filled = int(round(max(0.0, min(1.0, frac)) * 30))
    rate, tok = status["rate"]["req_per_s"], status["rate"]["tok_per_s"]
    kept = status.get("kept")
    mix = "  ".join(f"{n} {c:,}" for n, c in status["finish_reasons"].items()) or "—"
    lines: list[Any] = [
        Text(f"run {status['run']}  params v{status['params_version']}"
             + ("  finished: every prompt is done or failed" if status.get("finished") else ""),
             style="bold"),
        Text(f"{'█' * filled}{'░' * (30 - filled)} {frac:6.2%}  {done:,} / {total:,} done"
             + (f" samples ({status['prompts_done']:,} prompts with all {status['samples']})"
                if status.get("samples", 1) > 1 else "")
             + f"  turns {status.get('turns', 'last')}"),
        Text(f"queued {status['queued']:,}  in flight {status['inflight']:,} (running "
             f"{status.get('running', 0):,}, claimed ahead {status.get('claimed_ahead', 0):,})  "
             f"failed {status['failed']:,}  remaining {status['remaining']:,}"
             + (f"  kept {kept:,} (redo failed, previous result stands)" if kept else "")),
        Text(f"rate {rate:.2f} req/s  {tok:,.0f} tok/s (5 min)  "
             f"ETA {human_duration(status['eta_s'])}"),
        Text(f"finish {mix}  truncated {status['truncation_rate']:.1%} "
             f"(last 5 min {status['recent_truncation_rate']:.1%})"),
    ]
    if conv := status.get("conversations"):
        lines.append(Text(conversation_line(conv)))
    vt = status.get("version_truncation") or {}
    if vt.get("rate") is not None and status["params_version"] > 1:
        low, high = vt["ci"]
        lines.append(Text(
            f"under v{vt['version']}: {vt['rate']:.1%} truncated (95% CI {low:.1%}-{high:.1%}) "
            f"of {vt['completions']:,} completions, last hour"))
    o = status["output_tokens"]
    if o["max"] is not None:
        lines.append(Text(f"output tokens mean {o['mean']:,.0f}  p50 {o['p50']:,}  "
                          f"p90 {o['p90']:,}  p99 {o['p99']:,}  max {o['max']:,}"))
    if status.get("cached_prompt_tokens_total"):  # servers that report their prefix cache
        lines.append(Text(f"prompt tokens {status['prompt_tokens_total']:,}, cached "
                          f"{status['cached_prompt_tokens_total']:,} "
                          f"({status['cache_hit_share']:.1%} cache hits)"))
    for row in status.get("failure_reasons", []):
        lines.append(Text(f"failed {row['count']:,} x {row['reason']} "
                          f"(e.g. index {row['example_index']}"
                          + (f", sample {row['example_sample']})" if "example_sample" in row
                             else ")"), style="yellow"))
    ship = status.get("shipping")
    if ship:
        lines.append(Text(
            f"S3 shipped {ship['shards_shipped']:,} shards ({ship['bytes_shipped']:,} B)  "
            f"pending {ship['shards_pending']:,} ({ship['bytes_pending']:,} B)  "
            f"unshipped {ship['unshipped']:,}"
            + (f"  last error: {ship['last_error']}" if ship["last_error"] else "")))
    lines += [Text(f"  {line}", style="dim") for line in history_lines(status)]
    if status.get("recovered_at"):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(status["recovered_at"]))
        lines.append(Text(f"  rebuilt from its output by genq recover at {when}Z "
                          "(Redis had lost it)", style="dim"))
    if status["servers"]:
        lines.append(_server_table(status))
    for a in status.get("advice") or []:
        lines.append(Text(f"advice ({a['kind']}): {a['message']}", style="bold yellow"))
    for alert in status["alerts"]:
        if alert.get("kind") == "capacity":
            continue  # shown once above, as advice
        lines.append(Text(f"! {alert['message']}", style="bold red"))
        if alert.get("command"):
            lines.append(Text(f"  {alert['command']}", style="bold"))
    return Group(*lines)


def conversation_line(c: dict[str, Any]) -> str:
    """A --turns all run: its conversations (done, being redone, failed), their generations
    and how they ended."""
    each = f" ({c['turns_per_conversation']} turns each)" if c["turns_per_conversation"] else ""
    ended = "  ".join(f"{why} {n:,}" for why, n in sorted(c["stopped"].items())) or "—"
    cut = ", ".join(f"{t}: {n:,}" for t, n in c["truncated_by_turn"].items())
    rate = f" ({c['generations_per_s']:.2f}/s)" if c.get("generations_per_s") else ""
    others = "".join(f"  {c[key]:,} {name}" for key, name in (("redoing", "being redone"),
                                                               ("failed", "failed"))
                     if c.get(key))
    return (f"conversations {c['done']:,} / {c['total']:,} done{others}  generations "
            f"{c['generations']:,}{rate}{each}  ended {ended}"
            + (f"  truncated at turn {cut}" if cut else "")
            + (f"  boundary unstable {c['boundary_unstable']:,} of {c['boundary_checked']:,}"
               if c["boundary_checked"] else ""))

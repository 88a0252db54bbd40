"""The training configuration: a tree of plain dataclasses, loaded from TOML plus dotted overrides.

`RunConfig` holds one section per concern. `model`, `data`, `optim` and `train` are the run's
own; `offload` and `parallel` ARE the library's configs (moescale.offload.OffloadConfig,
moescale.parallel.ParallelConfig), nested as they are, with the run's defaults (`RUN_DEFAULTS`:
experts resident, one rank per expert group, deferred expert steps): the command line's
`--offload.tier disk` is `OffloadConfig.tier`, the library validates it, and the trainer hands
the section to `offload_moe` after filling in what the run derives (`DERIVED`: the device, the
precision, the optimizer, the planner's batch). A component that cannot serve a combination
refuses it itself (train/exchange.py `check_exchange`, train/residency.py `check_residency`).

`load_config(file, overrides)` reads `--config FILE.toml`, applies `--section.field value`
overrides converting the text by the field's annotated type (options.py: sizes such as '64MiB'
are parsed here, once), and builds every section (each validates itself; an error names the
option). Earlier option names still load (`ALIASES`: `offload.mode` is `offload.tier`, ...).
`help_text()` lists every option with its type, default, choices and its documentation (the
comment after the field, field_docs.py); `to_toml()` writes the resolved tree (None values are
omitted: TOML has no null).

This file builds no model and touches no tensors.
"""

from __future__ import annotations

import dataclasses
import re
from moescale.toml_compat import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path

import tomli_w

from moescale.offload.config import OFFLOAD_TIERS, PLANNER_RATES, OffloadConfig
from moescale.offload.experts import POLICIES
from moescale.offload.optimizer import STEP_MODES
from moescale.offload.state_format import MASTERS, MOMENTS
from moescale.parallel.groups import (BACKENDS, DENSE_MODES, PLACEMENTS, REUSE_CHOICES,
                                      ParallelConfig)
from moescale.routing.config import ROUTER_KINDS
from moescale.train.field_docs import field_docs
from moescale.train.options import convert, type_name

MODEL_SIZES = ("tiny", "small", "moe-s", "moe-m", "moe-l")
PRECISIONS = ("fp32", "bf16")
SCHEDULES = ("cosine", "linear", "constant")
TOKEN_DTYPES = ("uint8", "uint16", "uint32", "int32")

# The default run (`moescale train` with no options): the tiny model at batch 16 x 128 tokens.
# Measured on the 2-core AVX2 development machine at low load: ~3,000 tokens/s whether on 1 or 2
# threads (the tiny model's GEMMs are too small to split), i.e. ~0.65 s per step, so 500 steps
# (+ 5 validations, start-up and the sample) take about 5-6 minutes.
DEFAULT_STEPS = 500


def _need(cond: bool, option: str, value, fix: str) -> None:
    if not cond:
        raise ValueError(f"{option}={value!r} is invalid: {fix}")


# The model options that may be given with model.hf: they change training, not the Mixtral
# the run exports (top_k >= 2 is checked against the directory's config.json at start);
# num_experts sets the expert count of an upcycled dense model (a Mixtral's must match).
HF_TUNABLE = ("num_experts", "top_k", "aux_loss_coef", "z_loss_coef", "dropout")


@dataclass(kw_only=True)
class ModelSection:
    """The MoE GPT: a named size plus overrides, or an HF MoE directory (hf).

    The override fields are flat keys of the GPTConfig tree (moescale.config_tree: num_experts
    and top_k land in the router's config, d_ff in the MoE layer's); the run passes the ones
    given to gpt_config(size, **overrides), the one construction path. Fields left None take
    the size's value; with `hf` the shape is the directory's config.json (train/model.py) and
    only HF_TUNABLE fields may be given."""

    size: str = "tiny"          # a named shape (moescale.models.sizes); the fields below change it
    n_layers: int | None = None     # transformer blocks
    d_model: int | None = None      # model width
    n_heads: int | None = None      # attention heads (d_model / n_heads: even head width)
    d_ff: int | None = None         # hidden width of each expert (and of dense FFN layers)
    num_experts: int | None = None  # experts per MoE layer (with model.hf: of an upcycled dense
                                    # model; 8 unless given)
    top_k: int | None = None        # experts each token is routed to
    router: str | None = None       # topk (Mixtral) | noisy_topk | switch (top-1) | gshard (top-2)
    capacity_factor: float | None = None   # unset: dropless
    moe_every: int | None = None           # 1: every layer MoE, 2: every other, 0: dense
    glu: bool | None = None         # gated experts: (act(x W1) * x W3) W2 (SwiGLU with silu)
    activation: str | None = None   # the experts' nonlinearity: gelu | gelu_tanh | silu | relu
    aux_loss_coef: float | None = None   # weight of the load-balancing loss E * sum f_e P_e
    z_loss_coef: float | None = None     # weight of the router z-loss (0: off)
    dropout: float | None = None         # dropout after attention and FFN (0: none)
    hf: str | None = None       # a Hugging Face directory: a Mixtral (trained as it is) or a dense
                                # Llama / Mistral / Qwen2 (upcycled: every expert a copy of its
                                # MLP); its config.json is the model, its weights (if any) the
                                # start

    def __post_init__(self) -> None:
        _need(self.size in MODEL_SIZES, "model.size", self.size,
              f"choose one of {', '.join(MODEL_SIZES)}")
        if self.hf is not None:
            self._check_hf()
        for name in ("n_layers", "d_model", "n_heads", "d_ff", "num_experts", "top_k"):
            value = getattr(self, name)
            _need(value is None or value >= 1, f"model.{name}", value, "must be >= 1")
        if self.num_experts is not None and self.top_k is not None:
            _need(self.top_k <= self.num_experts, "model.top_k", self.top_k,
                  f"top_k must be <= model.num_experts={self.num_experts}")
        _need(self.router is None or self.router in ROUTER_KINDS, "model.router", self.router,
              f"choose one of {', '.join(ROUTER_KINDS)}")
        _need(self.moe_every is None or self.moe_every >= 0, "model.moe_every", self.moe_every,
              "must be >= 0 (0 builds a dense model)")
        _need(self.capacity_factor is None or self.capacity_factor > 0, "model.capacity_factor",
              self.capacity_factor, "must be > 0 (leave it unset for dropless routing)")
        for name in ("aux_loss_coef", "z_loss_coef"):
            value = getattr(self, name)
            _need(value is None or value >= 0, f"model.{name}", value, "must be >= 0")
        _need(self.dropout is None or 0 <= self.dropout < 1, "model.dropout", self.dropout,
              "must lie in [0, 1)")

    def _check_hf(self) -> None:
        """model.hf takes the shape from the directory: only options that leave the model a
        Mixtral (HF_TUNABLE) may be given with it."""
        _need(bool(str(self.hf).strip()), "model.hf", self.hf,
              "give an HF checkpoint or config directory (or leave model.hf unset)")
        self.hf = str(Path(self.hf).expanduser().absolute())   # later runs read it from anywhere
        _need(self.size == ModelSection.size, "model.size", self.size,
              f"model.hf={self.hf!r} gives the model's shape; drop --model.size")
        for name in self.shape_fields():
            value = getattr(self, name)
            _need(value is None or name in HF_TUNABLE, f"model.{name}", value,
                  f"model.hf={self.hf!r} gives the model's shape (its config.json); drop "
                  f"--model.{name} (with model.hf only {', '.join(HF_TUNABLE)} may be set)")

    @classmethod
    def shape_fields(cls) -> tuple[str, ...]:
        """The model options that are GPTConfig flat keys of the same names (size and hf, which
        pick where the shape comes from, excluded)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in ("size", "hf"))

    def overrides(self) -> dict:
        """The shape fields set explicitly (not None): passed to gpt_config."""
        return {name: getattr(self, name) for name in self.shape_fields()
                if getattr(self, name) is not None}


@dataclass(kw_only=True)
class DataSection:
    """Training text. path '' is the built-in corpus (the Python standard library's source)."""

    path: str = ""              # '' | text file | directory | saved HF dataset | token .bin;
                                # comma-separated list ok
    val_path: str = ""          # validation data, any kind data.path takes ('' -> nanoGPT's
                                # val.bin beside train.bin, else held out of data.path)
    cache_dir: str = ""         # '' -> ~/.cache/moescale (tokenized corpora, joined .bin files)
    val_fraction: float = 0.05  # share of files (or of the tail of one file) held out
    tokenizer: str = ""         # '' -> bytes; a tokenizer.json, or a directory with it or with
                                # GPT-2 style vocab.json + merges.txt (saved as an absolute path)
    text_column: str = "text"   # the text column of a dataset saved by datasets' save_to_disk
    token_dtype: str = ""       # element type of a token .bin ('' -> its NAME.bin.json sidecar)
    vocab_size: int = 0         # 0 -> the data's (tokenizer, sidecar, 256 for bytes); larger pads

    def __post_init__(self) -> None:
        _need(0 < self.val_fraction < 1, "data.val_fraction", self.val_fraction,
              "must lie strictly between 0 and 1")
        _need(self.token_dtype in ("",) + TOKEN_DTYPES, "data.token_dtype", self.token_dtype,
              f"choose one of {', '.join(TOKEN_DTYPES)} ('' reads the .bin's sidecar)")
        _need(self.vocab_size == 0 or self.vocab_size >= 2, "data.vocab_size", self.vocab_size,
              "must be 0 (the data's vocabulary) or >= 2")
        _need(bool(self.text_column.strip()), "data.text_column", self.text_column,
              "give the name of the dataset's text column")
        if self.tokenizer.strip():     # absolute, so the run decodes from anywhere later
            self.tokenizer = str(Path(self.tokenizer.strip()).expanduser().absolute())


@dataclass(kw_only=True)
class OptimSection:
    """AdamW and the learning-rate schedule (linear warmup, then decay to min_lr)."""

    lr: float = 3e-3            # peak learning rate, reached after warmup_steps
    min_lr: float = 3e-4        # the rate the schedule decays to
    warmup_steps: int = 30      # steps of linear warmup from 0
    schedule: str = "cosine"    # decay after warmup: cosine | linear | constant
    weight_decay: float = 0.1   # AdamW decoupled weight decay (matrices only, not norms/biases)
    beta1: float = 0.9          # AdamW first-moment decay
    beta2: float = 0.95         # AdamW second-moment decay
    eps: float = 1e-8           # AdamW denominator epsilon
    grad_clip: float = 1.0      # global norm; 0 disables clipping

    def __post_init__(self) -> None:
        _need(self.lr > 0, "optim.lr", self.lr, "must be > 0")
        _need(0 <= self.min_lr <= self.lr, "optim.min_lr", self.min_lr,
              f"must lie in [0, optim.lr={self.lr}]")
        _need(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "must be >= 0")
        _need(self.schedule in SCHEDULES, "optim.schedule", self.schedule,
              f"choose one of {', '.join(SCHEDULES)}")
        _need(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, "must be >= 0")
        for name in ("beta1", "beta2"):
            _need(0 <= getattr(self, name) < 1, f"optim.{name}", getattr(self, name),
                  "must lie in [0, 1)")
        _need(self.eps > 0, "optim.eps", self.eps, "must be > 0")
        _need(self.grad_clip >= 0, "optim.grad_clip", self.grad_clip,
              "must be >= 0 (0 disables clipping)")


# Counts past which one step, one evaluation or the sample would run for hours on any machine:
# refused at start instead of hanging (issue 31).
TRAIN_BOUNDS = {"grad_accum": 4096, "eval_batches": 10_000, "sample_tokens": 10_000}
TRAIN_BOUND_WHY = {"grad_accum": "micro-batches per optimizer step; raise train.batch_size",
                   "eval_batches": "batches per validation",
                   "sample_tokens": "tokens generated at the end"}


@dataclass(kw_only=True)
class TrainSection:
    """The loop: length, batch shape, evaluation, checkpoints, precision, where to write."""

    steps: int = DEFAULT_STEPS  # optimizer steps in all (--resume: raise it to train further)
    batch_size: int = 16        # sequences per micro-batch
    seq_len: int = 128          # tokens per sequence
    grad_accum: int = 1          # micro-batches per optimizer step
    eval_interval: int = 100     # steps between validation losses (0: only at the end)
    eval_batches: int = 8        # validation batches per validation loss (the same each time)
    checkpoint_interval: int = 250   # steps between checkpoints (0: only at the end)
    keep_last: int = 2           # checkpoints kept
    initial_checkpoint: bool = True  # save the initial state as step 0 (a safety net; false:
                                 # a disk-tier run's first steps do not rewrite its records
                                 # beside the initial masters: fp32 + int8 needs 6 bytes per
                                 # expert parameter of disk, not 10)
    seed: int = 1234             # seeds the model init, the batches and sampling
    precision: str = "fp32"      # fp32 | bf16 (autocast; the weights stay fp32)
    device: str = "auto"         # auto (cuda when present, else cpu) | cpu | cuda | cuda:N
    threads: int = 0             # torch threads (0: auto, the CPUs the load average leaves free)
    run_dir: str = ""            # '' -> runs/<timestamp>
    sample_tokens: int = 200     # length of the generated sample at the end (0: none)
    progress: bool = True        # tqdm progress bar on stderr
    report: bool = True          # draw report.png at the end (metrics.jsonl is always written;
                                 # moescale.train.report.write_report(run_dir) draws it later)
    tensorboard: bool = False    # also write the metrics as TensorBoard scalars to
                                 # <run_dir>/tensorboard (needs: pip install tensorboard)
    max_skips: int = 5           # consecutive non-finite steps (skipped) that stop the run

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "eval_batches",
                     "keep_last", "max_skips"):
            _need(getattr(self, name) >= 1, f"train.{name}", getattr(self, name),
                  "must be >= 1")
        for name in ("eval_interval", "checkpoint_interval", "threads", "sample_tokens"):
            _need(getattr(self, name) >= 0, f"train.{name}", getattr(self, name),
                  "must be >= 0")
        for name, most in TRAIN_BOUNDS.items():    # time, checked before anything is built
            _need(getattr(self, name) <= most, f"train.{name}", getattr(self, name),
                  f"must be <= {most:,} ({TRAIN_BOUND_WHY[name]})")
        _need(0 <= self.seed < 2**63, "train.seed", self.seed,
              "must lie in [0, 2**63 - 1] (a 64-bit seed)")
        _need(self.precision in PRECISIONS, "train.precision", self.precision,
              f"choose one of {', '.join(PRECISIONS)}")
        _need(re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None, "train.device",
              self.device, "use auto, cpu, cuda or cuda:N")


# The run's defaults of the library's sections: experts stay resident, no expert parallelism,
# experts step after global-norm clipping (the library's own defaults suit a direct call of
# offload_moe / init_distributed).
RUN_DEFAULTS = {"offload": {"tier": "device-only", "step_mode": "deferred"},
                "parallel": {"ep_size": 1}}

# Fields of the library's sections that the run sets from its other sections (the trainer's
# residency, train/residency.py): not options of their own.
DERIVED = {"offload.device": "train.device", "offload.compute_dtype": "train.precision",
           "offload.optimizer": "the [optim] section",
           "offload.tokens_per_micro_batch": "train.batch_size x train.seq_len",
           "offload.shared_memory": "parallel.placement (dynamic keeps the store in /dev/shm)",
           "offload.seed": "train.seed"}

# Option names of earlier versions (config.toml files of older runs, scripts) -> today's.
ALIASES = {"offload.mode": "offload.tier", "offload.device_budget": "offload.device_budget_bytes",
           "offload.host_budget": "offload.host_budget_bytes",
           "offload.host_cache": "offload.host_cache_bytes", "offload.disk_dir": "offload.directory",
           "parallel.memory_limit": "parallel.memory_limit_bytes"}


def _run_offload() -> OffloadConfig:
    return OffloadConfig(**RUN_DEFAULTS["offload"])


def _run_parallel() -> ParallelConfig:
    return ParallelConfig(**RUN_DEFAULTS["parallel"])


@dataclass(kw_only=True)
class RunConfig:
    """The whole configuration of one training run."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    offload: OffloadConfig = field(default_factory=_run_offload)
    parallel: ParallelConfig = field(default_factory=_run_parallel)


CHOICES = {"model.size": MODEL_SIZES, "model.router": ROUTER_KINDS, "optim.schedule": SCHEDULES,
           "train.precision": PRECISIONS, "offload.tier": OFFLOAD_TIERS,
           "offload.step_mode": STEP_MODES, "offload.activation_policy": POLICIES,
           "offload.rates": PLANNER_RATES, "offload.master": MASTERS,
           "offload.moments": MOMENTS, "parallel.reuse": REUSE_CHOICES,
           "parallel.placement": PLACEMENTS, "parallel.backend": BACKENDS,
           "parallel.dense": DENSE_MODES,
           "data.token_dtype": TOKEN_DTYPES}

SECTIONS = {f.name: f.type for f in dataclasses.fields(RunConfig)}


def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(RunConfig)
    return {name: hints[name] for name in SECTIONS}


def _options(section_cls, section: str) -> dict[str, object]:
    """{field: annotation} of a section's options (derived fields left out)."""
    return {name: hint for name, hint in typing.get_type_hints(section_cls).items()
            if f"{section}.{name}" not in DERIVED}


def _build(values: dict[str, dict[str, object]]) -> RunConfig:
    sections = {}
    for name, cls in _section_types().items():
        given = {**RUN_DEFAULTS.get(name, {}), **values.get(name, {})}
        try:
            sections[name] = cls(**given)
        except ValueError as err:       # the library's own message, named by the section
            text = str(err)
            raise ValueError(text if text.startswith(f"{name}.") else
                             f"{name}.{text}") from None
    return RunConfig(**sections)


def load_config(path: str | Path | None = None, overrides: dict[str, str] | None = None,
                base: dict | None = None) -> RunConfig:
    """Build a RunConfig from `base` (a dict tree), then a TOML file, then dotted overrides."""
    values: dict[str, dict[str, object]] = {}
    types_ = _section_types()

    def put(option: str, raw) -> None:
        option = ALIASES.get(option, option)
        section, _, name = option.partition(".")
        if section not in types_ or not name:
            raise ValueError(f"unknown option {option!r}; options look like "
                             f"--section.name with section one of {', '.join(types_)} "
                             "(see --help)")
        if option in DERIVED:
            raise ValueError(f"{option} is not an option: the run sets it from "
                             f"{DERIVED[option]}")
        hints = _options(types_[section], section)
        if name not in hints:
            raise ValueError(f"unknown option {option!r}; {section} has "
                             f"{', '.join(sorted(hints))} (see --help)")
        values.setdefault(section, {})[name] = convert(raw, hints[name], option)

    def put_tree(tree: dict, origin: str) -> None:
        for section, body in tree.items():
            if not isinstance(body, dict):
                raise ValueError(f"{origin}: {section!r} must be a table like [{section}] "
                                 "holding options")
            for name, raw in body.items():
                put(f"{section}.{name}", raw)

    if base:
        put_tree(base, "base config")
    if path is not None:
        path = Path(path)
        try:
            if not path.is_file():
                raise ValueError(f"--config {str(path)!r} does not exist; give a TOML file")
            tree = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as err:     # a permission error is not "does not exist"
            raise ValueError(f"--config {str(path)!r} cannot be read ({err.strerror}); check "
                             "its permissions") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as err:
            raise ValueError(f"--config {str(path)!r} is not valid TOML: "
                             f"{str(err) or 'nested too deeply'}") from None
        put_tree(tree, str(path))
    for option, raw in (overrides or {}).items():
        put(option, raw)
    try:
        return _build(values)
    except TypeError as err:  # pragma: no cover - put() already checks names
        raise ValueError(str(err)) from None


def saved_tree(run_dir: str | Path, who: str) -> dict:
    """The option tree in RUN_DIR/config.toml (what a run wrote), or a ValueError that starts
    with `who` (e.g. "--resume 'runs/x'") and says what is missing or damaged."""
    saved = Path(run_dir) / "config.toml"
    if not saved.is_file():
        raise ValueError(f"{who}: no config.toml there; give the directory of an earlier "
                         "`moescale train` run")
    try:
        return tomllib.loads(saved.read_text(encoding="utf-8"))
    except OSError as err:
        raise ValueError(f"{who}: its config.toml ({str(saved)!r}) cannot be read "
                         f"({err.strerror}); check its permissions") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise ValueError(f"{who}: its config.toml ({str(saved)!r}) is not valid UTF-8 TOML "
                         f"({err}); restore it, or start a new run") from None


def to_dict(config: RunConfig) -> dict:
    """The config as a nested dict of plain values, None values left out (TOML has no null)."""
    out = {}
    for name in SECTIONS:
        section = getattr(config, name)
        out[name] = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)
                     if getattr(section, f.name) is not None
                     and f"{name}.{f.name}" not in DERIVED}
    return out


def to_toml(config: RunConfig) -> str:
    return tomli_w.dumps(to_dict(config))


def help_text(size_defaults: dict | None = None) -> str:
    """Every option with its type, default, choices and documentation, section by section.
    `size_defaults` (the default size's GPTConfig fields) fills in the model options left to
    the size."""
    lines = []
    size_defaults = size_defaults or {}
    defaults = RunConfig()
    for section, cls in _section_types().items():
        lines.append(f"  [{section}]  {(cls.__doc__ or '').strip().splitlines()[0]}")
        docs = field_docs(cls)
        for name, hint in _options(cls, section).items():
            default = getattr(getattr(defaults, section), name)
            shown = repr(default)
            if default is None and name in ModelSection.shape_fields() and section == "model":
                shown = f"the size's ({ModelSection().size}: {size_defaults[name]!r})" \
                    if name in size_defaults else "the size's"
            option = f"--{section}.{name}"
            choices = CHOICES.get(option[2:])
            lines.append(f"    {option:<34} {type_name(hint):<12} default {shown}"
                         + (f"  [{' | '.join(choices)}]" if choices else ""))
            if docs.get(name):
                lines.append(f"        {docs[name]}")
    return "\n".join(lines)

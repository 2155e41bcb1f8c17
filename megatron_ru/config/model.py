"""Model architecture configuration (Megatron flag names)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from megatron_ru.config.base import arg

if TYPE_CHECKING:
    from megatron_ru.config.lora import LoraSpec


@dataclass
class ModelConfig:
    """Model architecture"""

    num_layers: Optional[int] = arg(None, "Number of transformer layers.")
    hidden_size: Optional[int] = arg(None, "Transformer hidden size.")
    ffn_hidden_size: Optional[int] = arg(
        None, "MLP hidden size. Default 4*hidden-size, or with --swiglu Megatron's "
              "int(4*hidden-size*2/3/64)*64.")
    num_attention_heads: Optional[int] = arg(None, "Number of attention (query) heads.")
    group_query_attention: bool = arg(False, "Use grouped-query attention (with --num-query-groups).")
    num_query_groups: int = arg(1, "Number of key/value heads with --group-query-attention "
                                   "(ignored otherwise: then every head has its own key/value).")
    max_position_embeddings: Optional[int] = arg(
        None, "Maximum sequence length; the size of the learned position table.")
    position_embedding_type: str = arg("learned_absolute", "Position embedding type.",
                                       choices=("learned_absolute", "rope"))
    rotary_base: float = arg(10000, "Base (theta) of the rotary position embedding frequencies, e.g. 500000 "
                                    "(LLaMA-3) or 1e6 (Qwen2).")
    rope_scaling_type: str = arg("none", "RoPE frequency scaling as transformers computes it: 'linear' divides "
                                         "every frequency by --rope-scaling-factor; 'llama3' (Llama 3.1/3.2) "
                                         "scales low frequencies and smooths the middle band.",
                                 choices=("none", "linear", "llama3"))
    rope_scaling_factor: float = arg(8.0, "RoPE scaling factor (linear and llama3).")
    rope_scaling_low_freq_factor: float = arg(1.0, "llama3 RoPE scaling: low-frequency factor.")
    rope_scaling_high_freq_factor: float = arg(4.0, "llama3 RoPE scaling: high-frequency factor.")
    rope_scaling_original_max_position_embeddings: Optional[int] = arg(
        None, "llama3 RoPE scaling: the context length of the original pretraining (8192 for Llama 3.1).")
    kv_channels: Optional[int] = arg(
        None, "Size of each attention head (default --hidden-size / --num-attention-heads); Mistral-Nemo and "
              "Qwen3-style models use a different head size.")
    add_qkv_bias: bool = arg(False, "Biases on the query, key and value projections only (Qwen2), also with "
                                    "--disable-bias-linear.")
    sliding_window: Optional[int] = arg(
        None, "Sliding-window attention size of the model (Mistral's config.json sliding_window): a token "
              "attends to itself and the window-1 tokens before it (as transformers). Training with "
              "--seq-length above it is refused.")
    qk_layernorm: bool = arg(
        False, "Normalize every attention head's query and key before RoPE, with the norm of --normalization over "
               "the head size (one weight of --kv-channels shared by the heads, replicated across TP ranks): "
               "Qwen3's and Gemma 3's q_norm/k_norm (Megatron's flag).")
    apply_layernorm_1p: bool = arg(
        False, "Norm weights centred on zero: every norm scales by (1 + w), its weight starting at 0 (Megatron's "
               "flag; the same layer and training as a weight w starting at 1, where norm weights take no weight "
               "decay; Gemma's RMSNorm stores its weights this way).")
    sandwich_norm: bool = arg(
        False, "Normalize the attention and MLP outputs too, before each residual add (four norms a layer: "
               "Gemma 2/3's post_attention_layernorm and post_feedforward_layernorm).")
    scale_embeddings: bool = arg(
        False, "Multiply the word embeddings by sqrt(--hidden-size), rounded to the model's dtype (Gemma).")
    softmax_scale: Optional[float] = arg(
        None, "Scale of the attention scores (default 1/sqrt(head size)); Gemma 3: query_pre_attn_scalar ** -0.5.")
    window_attn_skip_freq: Optional[int] = arg(
        None, "With --sliding-window: every N-th layer (N, 2N, ... counted from 1) attends to the whole sequence, "
              "the others within the window (Megatron's flag; Gemma 3: 6, five local layers to a global one).")
    rotary_base_local: Optional[float] = arg(
        None, "RoPE base of the sliding-window layers when --window-attn-skip-freq mixes them with global ones "
              "(Gemma 3: 10000; the global layers keep --rotary-base and its scaling).")
    normalization: str = arg("LayerNorm", "Normalization layer (Megatron-DeepSpeed's lower-case spellings too).",
                             choices=("LayerNorm", "RMSNorm", "layernorm", "rmsnorm"))
    norm_epsilon: float = arg(1e-5, "Epsilon of LayerNorm/RMSNorm.")
    swiglu: bool = arg(False, "Use SwiGLU instead of GELU in the MLP.")
    geglu: bool = arg(False, "A gated MLP with GELU in its tanh approximation instead of SiLU (Gemma's "
                             "gelu_pytorch_tanh); linear_fc1 holds [gate; up] as with --swiglu.")
    disable_bias_linear: bool = arg(False, "No biases in the attention and MLP linear layers.")
    untie_embeddings_and_output_weights: bool = arg(
        False, "Separate output layer weights instead of reusing the input embedding.")
    hidden_dropout: float = arg(0.1, "Dropout on the residual branches and embeddings.")
    attention_dropout: float = arg(0.1, "Dropout on attention probabilities.")
    make_vocab_size_divisible_by: int = arg(
        128, "Pad the vocabulary to a multiple of this times the tensor-parallel size.")
    init_method_std: float = arg(0.02, "Standard deviation of the normal weight initialisation.")
    recompute_granularity: Optional[str] = arg(
        None, "Activation recomputation: 'full' recomputes each transformer layer in backward (only its input is "
              "kept); 'selective' (Megatron's) recomputes the core attention only (its s x s scores, softmax and "
              "dropout mask are not kept). The same losses and gradients either way.",
        choices=("full", "selective"))
    checkpoint_activations: bool = arg(False, "Alias of --recompute-granularity full.")
    recompute_method: Optional[str] = arg(
        None, "With --recompute-granularity full (Megatron's): 'uniform' recomputes the transformer layers of each "
              "pipeline stage in chunks of --recompute-num-layers (only each chunk's input is kept); 'block' "
              "recomputes the first --recompute-num-layers layers of each stage one by one and keeps all the "
              "activations of the others. Default: uniform chunks of 1 layer.", choices=("uniform", "block"))
    recompute_num_layers: Optional[int] = arg(
        None, "Layers per recomputed chunk (uniform) or recomputed layers per pipeline stage (block); default 1.")
    distribute_saved_activations: bool = arg(
        False, "With --recompute-granularity full and TP > 1 (without --sequence-parallel): each tensor-parallel "
               "rank keeps only its 1/TP of every recomputed chunk's input and they are all-gathered in backward "
               "(Megatron's flag; Megatron-DeepSpeed's --distribute-checkpointed-activations).")
    #: LoRA/DoRA adapters the model is built with (LoraSpec as a dict; set from the --lora-* flags or a
    #: checkpoint's model arguments; not a flag itself). None: no adapters.
    lora: Optional[dict[str, Any]] = field(default=None, metadata={"cli": False})

    # ---- derived values (resolved from the flags above) ----
    @property
    def lora_spec(self) -> Optional["LoraSpec"]:
        from megatron_ru.config.lora import LoraSpec
        return LoraSpec.from_dict(self.lora)

    @property
    def resolved_ffn_hidden_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        assert self.hidden_size is not None
        if self.gated_mlp:
            return int((4 * self.hidden_size * 2 / 3) / 64) * 64
        return 4 * self.hidden_size

    @property
    def gated_mlp(self) -> bool:
        """linear_fc1 holds [gate; up] (SwiGLU or GeGLU)."""
        return self.swiglu or self.geglu

    def layer_is_local(self, layer_number: int) -> bool:
        """Whether decoder layer ``layer_number`` (0-based) attends within --sliding-window."""
        if self.sliding_window is None:
            return False
        freq = self.window_attn_skip_freq
        return freq is None or (layer_number + 1) % freq != 0

    @property
    def query_groups(self) -> int:
        assert self.num_attention_heads is not None
        return self.num_query_groups if self.group_query_attention else self.num_attention_heads

    @property
    def head_dim(self) -> int:
        if self.kv_channels is not None:
            return self.kv_channels
        assert self.hidden_size is not None and self.num_attention_heads is not None
        return self.hidden_size // self.num_attention_heads

    @property
    def add_qkv_bias_effective(self) -> bool:
        """Whether linear_qkv has a bias (every linear layer has one unless --disable-bias-linear)."""
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def recompute(self) -> bool:
        return self.recompute_granularity == "full" or self.checkpoint_activations

    @property
    def add_bias_linear(self) -> bool:
        return not self.disable_bias_linear

    @property
    def tied_embeddings(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    def __post_init__(self) -> None:
        # Megatron-DeepSpeed's scripts write --normalization rmsnorm / layernorm
        self.normalization = {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm"}.get(self.normalization,
                                                                                  self.normalization)

    def problems(self) -> list[str]:
        found: list[str] = []
        for name in ("num_layers", "hidden_size", "num_attention_heads"):
            value = getattr(self, name)
            flag = "--" + name.replace("_", "-")
            if value is None:
                found.append(f"{flag} is required")
            elif value < 1:
                found.append(f"{flag} must be >= 1, got {value}")
        if found:
            return found
        heads, hidden = self.num_attention_heads, self.hidden_size
        if self.kv_channels is not None:
            if self.kv_channels < 1:
                found.append(f"--kv-channels must be >= 1, got {self.kv_channels}")
            elif self.position_embedding_type == "rope" and self.kv_channels % 2:
                found.append(f"rotary embeddings need an even head size; --kv-channels is {self.kv_channels}")
        elif hidden % heads:
            found.append(f"--hidden-size ({hidden}) must be divisible by --num-attention-heads ({heads}), or give "
                         f"the head size with --kv-channels")
        elif self.position_embedding_type == "rope" and (hidden // heads) % 2:
            found.append(f"rotary embeddings need an even head size; --hidden-size/--num-attention-heads "
                         f"= {hidden // heads}")
        if self.rope_scaling_type != "none":
            if self.position_embedding_type != "rope":
                found.append(f"--rope-scaling-type {self.rope_scaling_type} needs --position-embedding-type rope")
            if self.rope_scaling_factor <= 0:
                found.append(f"--rope-scaling-factor must be > 0, got {self.rope_scaling_factor}")
        if self.rope_scaling_type == "llama3":
            if self.rope_scaling_original_max_position_embeddings is None:
                found.append("--rope-scaling-type llama3 needs --rope-scaling-original-max-position-embeddings "
                             "(the original context length, 8192 for Llama 3.1)")
            elif self.rope_scaling_original_max_position_embeddings < 1:
                found.append(f"--rope-scaling-original-max-position-embeddings must be >= 1, got "
                             f"{self.rope_scaling_original_max_position_embeddings}")
            if not 0 < self.rope_scaling_low_freq_factor < self.rope_scaling_high_freq_factor:
                found.append(f"llama3 RoPE scaling needs 0 < --rope-scaling-low-freq-factor "
                             f"({self.rope_scaling_low_freq_factor}) < --rope-scaling-high-freq-factor "
                             f"({self.rope_scaling_high_freq_factor})")
        if self.sliding_window is not None and self.sliding_window < 1:
            found.append(f"--sliding-window must be >= 1, got {self.sliding_window}")
        if self.swiglu and self.geglu:
            found.append("--swiglu and --geglu are two gated MLPs: give one")
        if self.window_attn_skip_freq is not None:
            if self.window_attn_skip_freq < 1:
                found.append(f"--window-attn-skip-freq must be >= 1, got {self.window_attn_skip_freq}")
            if self.sliding_window is None:
                found.append("--window-attn-skip-freq needs --sliding-window (the window of the other layers)")
        if self.rotary_base_local is not None:
            if self.window_attn_skip_freq is None or self.position_embedding_type != "rope":
                found.append("--rotary-base-local needs --window-attn-skip-freq and --position-embedding-type rope")
            elif self.rotary_base_local <= 0:
                found.append(f"--rotary-base-local must be > 0, got {self.rotary_base_local}")
        if self.softmax_scale is not None and self.softmax_scale <= 0:
            found.append(f"--softmax-scale must be > 0, got {self.softmax_scale}")
        if self.group_query_attention:
            groups = self.num_query_groups
            if groups < 1 or heads % groups:
                found.append(f"--num-attention-heads ({heads}) must be divisible by --num-query-groups "
                             f"({groups})")
        if self.ffn_hidden_size is not None and self.ffn_hidden_size < 1:
            found.append(f"--ffn-hidden-size must be >= 1, got {self.ffn_hidden_size}")
        if self.position_embedding_type == "learned_absolute":
            if self.max_position_embeddings is None:
                found.append("--max-position-embeddings is required with --position-embedding-type "
                             "learned_absolute")
        if self.max_position_embeddings is not None and self.max_position_embeddings < 1:
            found.append(f"--max-position-embeddings must be >= 1, got {self.max_position_embeddings}")
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                found.append(f"--{name.replace('_', '-')} must be in [0, 1), got {value}")
        if self.make_vocab_size_divisible_by < 1:
            found.append(f"--make-vocab-size-divisible-by must be >= 1, got {self.make_vocab_size_divisible_by}")
        if self.norm_epsilon <= 0:
            found.append(f"--norm-epsilon must be > 0, got {self.norm_epsilon}")
        if self.init_method_std <= 0:
            found.append(f"--init-method-std must be > 0, got {self.init_method_std}")
        if self.rotary_base <= 0:
            found.append(f"--rotary-base must be > 0, got {self.rotary_base}")
        found += self._recompute_problems()
        return found

    def _recompute_problems(self) -> list[str]:
        found = []
        full = self.recompute
        for flag, given in (("--recompute-method", self.recompute_method is not None),
                            ("--recompute-num-layers", self.recompute_num_layers is not None),
                            ("--distribute-saved-activations", self.distribute_saved_activations)):
            if given and not full:
                found.append(f"{flag} applies to --recompute-granularity full (or --checkpoint-activations)"
                             + (f", not {self.recompute_granularity}" if self.recompute_granularity else
                                ": add it"))
        n = self.recompute_num_layers
        if n is not None and (n < 0 or (n == 0 and self.recompute_method != "block")):
            found.append(f"--recompute-num-layers must be >= 1 (>= 0 with --recompute-method block), got {n}")
        return found

    @property
    def recompute_plan(self) -> tuple[str, int]:
        """("none" | "uniform" | "block", layers): how --recompute-granularity full recomputes a pipeline stage's
        transformer layers (uniform: chunks of ``layers``; block: its first ``layers``, one by one)."""
        if not self.recompute:
            return "none", 0
        return self.recompute_method or "uniform", 1 if self.recompute_num_layers is None else self.recompute_num_layers


def model_parallel_problems(cfg: ModelConfig, tp: int, pp: int = 1, tp_flag: str = "--tensor-model-parallel-size",
                            pp_flag: str = "--pipeline-model-parallel-size") -> list[str]:
    """Rules that depend on the layout: what must divide by TP (``tp_flag``), and at most one pipeline stage
    (``pp_flag``) per transformer layer. The one rule for training, the converters (their --target-* flags),
    inference and the planner: a converter never writes a layout that ``pretrain_gpt.py`` refuses."""
    if tp < 1 or pp < 1:
        return [f"{tp_flag} ({tp}) and {pp_flag} ({pp}) must be >= 1"]
    found: list[str] = []
    if cfg.num_attention_heads and cfg.num_attention_heads % tp:
        found.append(f"--num-attention-heads ({cfg.num_attention_heads}) must be divisible by "
                     f"{tp_flag} ({tp})")
    if cfg.num_attention_heads and cfg.group_query_attention and cfg.num_query_groups % tp:
        found.append(f"--num-query-groups ({cfg.num_query_groups}) must be divisible by "
                     f"{tp_flag} ({tp})")
    if cfg.hidden_size and cfg.num_attention_heads:
        ffn = cfg.resolved_ffn_hidden_size
        if ffn % tp:
            found.append(f"the MLP size --ffn-hidden-size ({ffn}) must be divisible by "
                         f"{tp_flag} ({tp})")
    if cfg.num_layers and pp > cfg.num_layers:
        # an uneven split is fine: stages take balanced layer counts as DeepSpeed partitions them
        found.append(f"{pp_flag} ({pp}) exceeds --num-layers ({cfg.num_layers}): every "
                     f"pipeline stage needs at least one transformer layer")
    return found

"""The `model:` and `lora:` sections: the frozen checkpoint, its formats and the adapter."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from moe_lora.tiny import TinySpec
from quant.formats import FORMATS
from quant.layout import QUANTIZABLE_GROUPS


@dataclass
class QuantSection:
    routed_experts: str = "nf4"
    shared_experts: str = "bf16"
    attention: str = "bf16"
    dense_mlp: str = "bf16"
    double_quant: bool = False

    def plan(self, overrides: dict | None = None):
        """The quant.loader.QuantPlan these formats describe (what the frozen model is loaded and trained in), with
        `overrides` (rollout.engine_formats: some of the same keys) in place of these where given."""
        from quant.loader import QuantPlan

        return QuantPlan(**{**asdict(self), **(overrides or {})})

    def check(self, fail) -> None:
        for group in QUANTIZABLE_GROUPS:
            if getattr(self, group) not in FORMATS:
                fail(f"model.quant.{group} = {getattr(self, group)!r}: unknown format (valid: {', '.join(FORMATS)})")


# Tuned on the 2-core CPU machine (see the report in warm_start.json of a run). The step count sets how much
# RL can add: measured held-out avg@4 of the base -> after 5 min of the default RL: 500 steps 5% (too weak:
# few mixed groups), 750 steps 27% -> 41%, 1000 steps 53% -> 59% (most problems already always right or
# always wrong, so few groups carry signal).
DEFAULT_SPEC = TinySpec(  # the warm-started base's model (allsync/warm_start.py)
    layers=2,
    dense_layers=1,
    experts=4,
    experts_per_token=2,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=128,
    heads=2,
    n_group=2,
    topk_group=1,
)
# the fields of moe_lora.tiny.TinySpec that model.warm_start_shape may set (the model's shape, not its format or seed)
WARM_START_SHAPE_KEYS = (
    "layers",
    "dense_layers",
    "experts",
    "experts_per_token",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "heads",
    "n_group",
    "topk_group",
    "max_position_embeddings",
)
WARM_START_STEPS = 750  # the default base's supervised steps (tuned for RL headroom; allsync/warm_start.py)


@dataclass
class ModelSection:
    base: str = "runs/tiny-base"  # checkpoint directory
    warm_start: bool = (
        False  # build `base` with allsync.warm_start (tiny model, supervised on the run's task) when it is missing
    )
    # supervised steps of that warm start (a weaker base leaves RL more headroom); part of the base's stored settings
    warm_start_steps: int = WARM_START_STEPS
    # the warm-started model's shape where it differs from the default's (DEFAULT_SPEC: 2 layers,
    # the first dense, 4 routed experts, hidden 128): moe_lora.tiny.TinySpec's fields, e.g. {layers: 3} for two MoE
    # layers; part of the base's stored settings like the steps
    warm_start_shape: dict[str, int] = field(default_factory=dict)
    compute_dtype: str = "float32"  # bfloat16 on GPUs
    # keep every frozen weight dequantized in compute_dtype beside its stored format (dequantized once, not at
    # every forward and backward): the same numbers, faster, but 4 (float32) or 2 bytes per parameter more.
    # For small models; refused when the copy would take more than half the device's free memory
    compute_copy: bool = False
    quant: QuantSection = field(default_factory=QuantSection)

    def check(self, fail) -> None:
        self.quant.check(fail)
        if self.warm_start_steps < 1:
            fail(f"model.warm_start_steps = {self.warm_start_steps}: must be >= 1")
        if self.warm_start_steps != WARM_START_STEPS and not self.warm_start:
            fail(f"model.warm_start_steps = {self.warm_start_steps} without model.warm_start: nothing is warm-started")
        if self.warm_start_shape and not self.warm_start:
            fail("model.warm_start_shape without model.warm_start: nothing is warm-started")
        self.check_warm_start_shape(fail)
        if self.compute_dtype not in ("float32", "bfloat16"):
            fail(f"model.compute_dtype = {self.compute_dtype!r}: use float32 or bfloat16")

    def check_warm_start_shape(self, fail) -> None:
        """Every key of model.warm_start_shape is one of WARM_START_SHAPE_KEYS, a positive integer (dense_layers may
        be 0), and the shape they make with the default's other fields is one moe_lora.tiny.TinySpec builds."""
        for key, value in self.warm_start_shape.items():
            if key not in WARM_START_SHAPE_KEYS:
                fail(f"model.warm_start_shape.{key}: not a shape key (use {', '.join(WARM_START_SHAPE_KEYS)})")
            least = 0 if key == "dense_layers" else 1  # a model of MoE layers only has no dense layer
            if value < least:
                fail(f"model.warm_start_shape.{key} = {value}: must be >= {least}")
        try:
            replace(DEFAULT_SPEC, **self.warm_start_shape).validate()
        except ValueError as error:
            fail(f"model.warm_start_shape = {self.warm_start_shape}: {error}")


@dataclass
class LoRASection:
    rank: int = 8
    alpha: float = 16.0
    targets: list[str] = field(
        default_factory=lambda: [
            "q_a_proj",
            "q_b_proj",
            "kv_a_proj_with_mqa",
            "o_proj",
            "dense_mlp",
            "shared_experts",
            "routed_experts",
        ]
    )
    dropout: float = 0.0
    use_rslora: bool = False
    expert_kernel: str = "auto"  # routed experts: loop | grouped_mm | auto (grouped_mm on GPUs where the rank allows)
    # routed experts: per_expert (A_e, B_e for every projection) | shared_outer (A of gate/up and B of down shared by
    # the layer's experts: moe_lora/lora_layers.py)
    expert_layout: str = "per_expert"

    def check(self, fail) -> None:
        from moe_lora.lora import TARGETS
        from moe_lora.lora_layers import LoRAExperts

        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown:
            fail(f"lora.targets: unknown target {unknown[0]!r} (valid: {', '.join(TARGETS)})")
        if self.expert_layout not in LoRAExperts.layouts:
            fail(f"lora.expert_layout = {self.expert_layout!r}: use {' or '.join(LoRAExperts.layouts)}")
        if self.expert_layout == "shared_outer" and "routed_experts" not in self.targets:
            fail("lora.expert_layout = shared_outer: lora.targets has no routed_experts, the only module it lays out")
        if self.rank < 1:
            fail(f"lora.rank = {self.rank}: must be >= 1")
        if self.dropout != 0:
            fail(
                f"lora.dropout = {self.dropout}: RL trains on-policy, so the trainer's forward must be the policy that "
                "sampled (ratio 1 before the first update); dropout would make every ratio noise. Use 0"
            )

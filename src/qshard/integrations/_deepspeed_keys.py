"""The static data of :mod:`qshard.integrations.deepspeed`: every DeepSpeed config key qshard
knows, section by section, and where each one ends (see that module's docstring): mapped to a
qshard setting, accepted with no equivalent (with the reason), accepted only at the value that
matches qshard, or refused (with the fix); DeepSpeed's defaults for the optimizers it maps; the
Hugging Face Trainer settings that fill ``"auto"`` values; and two pure look-ups over these
tables. Nothing here reads a config: the reader is in :mod:`qshard.integrations.deepspeed`.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "_ACTIVATION_CHECKPOINTING_KEYS",
    "_ADAM_DEFAULTS",
    "_ADAM_NO_EQUIVALENT",
    "_BF16_NO_EQUIVALENT",
    "_BF16_ONLY_DEFAULT",
    "_DISABLED_SECTION_KEYS",
    "_FP16_NO_EQUIVALENT",
    "_HF_AUTO_SOURCES",
    "_OFFLOAD_KEYS",
    "_ONEBIT_DEFAULTS",
    "_ONEBIT_NO_EQUIVALENT",
    "_OPTIMIZER_TYPES",
    "_TOP_MAPPED",
    "_TOP_NO_EQUIVALENT",
    "_TOP_ONLY_DEFAULT",
    "_TOP_REFUSED",
    "_TORCH_ADAMW_WEIGHT_DECAY",
    "_ZERO_ALIASES",
    "_ZERO_MAPPED",
    "_ZERO_NO_EQUIVALENT",
    "_ZERO_ONE_DEFAULTS",
    "_ZERO_ONLY_DEFAULT",
    "_auto_is_moot",
    "_is_default",
]


# --- zero_optimization ------------------------------------------------------------------------

_STAGE12 = "a ZeRO stage 1/2 option (qshard shards parameters too: FSDP2 is ZeRO-3)"
_DS_INTERNAL = "a DeepSpeed implementation detail with no FSDP2 counterpart"
_PER_UNIT = "FSDP2 communicates one FSDP unit (a block) per collective: there are no buckets"
_FULL_STATE = (
    "qshard checkpoints with DCP (shards by global layout); a full state dict comes from "
    "torch.distributed.checkpoint.state_dict.get_model_state_dict(model, "
    "options=StateDictOptions(full_state_dict=True))"
)
_REGATHER = (
    "FSDP2 frees each unit after its forward and gathers it again for backward (ZeRO-3; hpZ "
    "keeps that gather inside the node), except the root and the last "
    "ZeroPPConfig.keep_last_blocks blocks (default prefetch_depth + 1), which stay unsharded "
    "until their backward; there is no residency budget in bytes"
)

_ZERO_NO_EQUIVALENT: dict[str, str] = {
    "contiguous_gradients": "FSDP2 reduces each unit's gradients from one contiguous buffer",
    "reduce_bucket_size": _PER_UNIT,
    "allgather_bucket_size": _PER_UNIT,
    "prefetch_bucket_size": "FSDP2 prefetches whole units, one block ahead (ZeroPPConfig.prefetch)",
    "param_persistence_threshold": (
        "every parameter is sharded; small ones (norm gains, biases) travel in their unit's "
        "flat all-gather"
    ),
    "model_persistence_threshold": "every parameter is sharded (see param_persistence_threshold)",
    "max_live_parameters": _REGATHER,
    "max_reuse_distance": _REGATHER,
    "gather_16bit_weights_on_model_save": _FULL_STATE,
    "stage3_gather_fp16_weights_on_model_save": _FULL_STATE,
    "sub_group_size": "the optimizer steps each rank's whole shard (tiles matter with offload)",
    "elastic_checkpoint": "DCP checkpoints load on any number of ranks",
    "load_from_fp32_weights": "qshard's parameters are the fp32 master weights",
    "cpu_offload_use_pin_memory": "only with offload, which is refused",
    "round_robin_gradients": _STAGE12,
    "ignore_unused_parameters": _STAGE12,
    "legacy_stage1": _STAGE12,
    "use_multi_rank_bucket_allreduce": _STAGE12,
    "parameter_alignment": _STAGE12,
    "compute_grad_norm": _STAGE12,
    "memory_efficient_linear": _DS_INTERNAL,
    "override_module_apply": _DS_INTERNAL,
    "pipeline_loading_checkpoint": _DS_INTERNAL,
    "log_trace_cache_warnings": _DS_INTERNAL,
    "enable_sanity_checks": _DS_INTERNAL,
    "module_granularity_threshold": _DS_INTERNAL,
    "use_all_reduce_for_fetch_params": _DS_INTERNAL,
    "allgather_sequential": _DS_INTERNAL,
    "leaf_module": _DS_INTERNAL,
    "save_muon_momentum_buffer_in_memory": _DS_INTERNAL,
}
# DeepSpeed accepts these stage-3 options under a "stage3_" alias as well.
_ZERO_ALIASES = {
    f"stage3_{name}": name
    for name in (
        "prefetch_bucket_size",
        "param_persistence_threshold",
        "model_persistence_threshold",
        "max_live_parameters",
        "max_reuse_distance",
        "gather_16bit_weights_on_model_save",
        "module_granularity_threshold",
        "use_all_reduce_for_fetch_params",
        "allgather_sequential",
    )
}
_ZERO_MAPPED = (
    "stage",
    "zero_quantized_weights",
    "zero_hpz_partition_size",
    "zero_quantized_gradients",
    "overlap_comm",
)
_NO_OPTIMIZER_OFFLOAD = (
    "qshard has no CPU/NVMe offload (to shrink the optimizer state on the GPU instead, build "
    "qshard.optim.AdamW8bit or AdamW4bit with t.optimizer_kwargs)"
)
# Accepted only at the value that matches qshard: (DeepSpeed's default, why another is refused).
_ZERO_ONLY_DEFAULT: dict[str, tuple[Any, str]] = {
    "reduce_scatter": (True, "FSDP2 always reduce-scatters gradients"),
    "allgather_partitions": (True, "FSDP2 always all-gathers parameters"),
    "zero_quantized_nontrainable_weights": (
        False,
        "qshard keeps frozen weights in full precision (qwZ quantizes on the wire only)",
    ),
    "offload_param": (None, "qshard has no CPU/NVMe offload"),
    "offload_optimizer": (None, _NO_OPTIMIZER_OFFLOAD),
    "cpu_offload": (None, _NO_OPTIMIZER_OFFLOAD),  # offload_optimizer's old name
    "cpu_offload_param": (None, "qshard has no CPU/NVMe offload"),
    "zenflow": (None, "qshard has no ZenFlow (offloaded optimizer steps)"),
    "zeropp_loco_param": (
        None,
        "qshard's qgZ has no LoCo error feedback (err_beta, reset_T); plain qgZ is "
        "zero_quantized_gradients",
    ),
    "mics_shard_size": (
        -1,
        "qshard has no MiCS; its sharded-inside-a-node, replicated-across-nodes layout is HSDP: "
        "qshard.shard(..., config=ZeroPPConfig(hsdp=True)) (docs/hsdp.md)",
    ),
    "mics_hierarchical_params_gather": (False, "qshard has no MiCS (see mics_shard_size)"),
}

# The fields of DeepSpeed's DeepSpeedZeroOffloadParamConfig / ...OffloadOptimizerConfig.
_OFFLOAD_KEYS = {
    "offload_param": ("device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu"),
    "offload_optimizer": (
        "device",
        "nvme_path",
        "buffer_count",
        "pipeline_read",
        "pipeline_write",
        "fast_init",
        "ratio",
        "super_offload",
        "convert_grad_on_cpu",
        "cpuadam_cores_perc",
    ),
}

# --- optimizer --------------------------------------------------------------------------------

_ADAM_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
_ONEBIT_DEFAULTS = {**_ADAM_DEFAULTS, "freeze_step": 100_000}
_ZERO_ONE_DEFAULTS = {
    **_ADAM_DEFAULTS,
    "var_freeze_step": 100_000,
    "var_update_scaler": 16,
    "local_step_scaler": 32678,
    "local_step_clipper": 16,
}
_ONEBIT_NO_EQUIVALENT = {
    "bias_correction": (
        "DeepSpeed's 1-bit step never applies it (its update is m / (sqrt(v) + eps)); qshard's "
        "step is the same (bias_correction=False)"
    ),
    "eps_inside_sqrt": "DeepSpeed's 1-bit step never reads it (eps is outside the sqrt)",
    "cuda_aware": "qshard communicates through torch.distributed's process group",
    "comm_backend_name": "qshard communicates through torch.distributed's process group",
}
_ADAM_NO_EQUIVALENT = {
    "torch_adam": (
        "qshard uses torch.optim's Adam/AdamW (DeepSpeed's FusedAdam computes the same); with "
        "torch_adam and no weight_decay, AdamW gets torch's default 0.01, as in DeepSpeed"
    ),
    "set_grad_none": "torch optimizers set gradients to None in zero_grad() by default",
}
_OPTIMIZER_TYPES = ("adam", "adamw", "onebitadam", "zerooneadam")
# torch.optim.AdamW's weight_decay default: what DeepSpeed's torch_adam: true path gets when
# the config gives none (its FusedAdam's default is 0).
_TORCH_ADAMW_WEIGHT_DECAY = 0.01

# --- the top level ----------------------------------------------------------------------------

_LOGGING = "logging/monitoring; qshard reports through its CommLedger and your own logging"
_TOP_NO_EQUIVALENT: dict[str, str] = {
    "steps_per_print": _LOGGING,
    "wall_clock_breakdown": _LOGGING,
    "memory_breakdown": _LOGGING,
    "dump_state": _LOGGING,
    "tensorboard": _LOGGING,
    "wandb": _LOGGING,
    "csv_monitor": _LOGGING,
    "comet": _LOGGING,
    "flops_profiler": _LOGGING,
    "timers": _LOGGING,
    "checkpoint": "checkpoint I/O options of DeepSpeed's engine; qshard checkpoints with DCP",
    "aio": "NVMe I/O options (offload is refused)",
    "zero_allow_untested_optimizer": "FSDP2 shards for any torch optimizer",
    "zero_force_ds_cpu_optimizer": "only with offload, which is refused",
    "dataloader_drop_last": "qshard does not build your data loader",
    "autotuning": "DeepSpeed's autotuner; qshard has none",
    "seq_parallel_communication_data_type": "qshard has no sequence parallelism",
    "comms_logger": _LOGGING,
    "log_level": _LOGGING,
    "vocabulary_size": "DeepSpeed only warns when it is not a multiple of 8",
    "nebula": "a DeepSpeed checkpoint engine; qshard checkpoints with DCP",
    "datastates": "a DeepSpeed checkpoint engine; qshard checkpoints with DCP",
    "graph_harvesting": "a DeepSpeed CUDA-graph implementation detail",
}
_TOP_REFUSED: dict[str, str] = {
    "scheduler": (
        "qshard does not own the learning-rate schedule: set the lr per step in your loop "
        "(qshard train: --lr, --warmup-steps, --min-lr)"
    ),
    "pipeline": "qshard has no pipeline parallelism",
    "sparse_attention": "qshard has no sparse attention kernels",
    "elasticity": "qshard has no elastic batch sizing (torchrun restarts are separate)",
    "compression_training": "qshard has no compression training",
    "data_efficiency": "qshard has no data-efficiency pipeline",
    "curriculum_learning": "qshard has no curriculum learning",
    "progressive_layer_drop": "qshard has no progressive layer drop",
    "eigenvalue": "qshard has no eigenvalue-based scaling",
    "quantize_training": "qshard has no quantization-aware training (qwZ quantizes the wire only)",
    "weight_quantization": "qshard has no weight quantization for inference",
    "hybrid_engine": "qshard has no RLHF hybrid engine",
    "compile": "compile the model with torch.compile yourself",
    "tensor_parallel": "qshard has no tensor parallelism (it shards data-parallel only)",
    "expert_parallel": "qshard has no expert parallelism",
}
_TOP_ONLY_DEFAULT: dict[str, tuple[Any, str]] = {
    "prescale_gradients": (False, "FSDP2 averages after the reduction"),
    "gradient_predivide_factor": (1.0, "FSDP2 averages after the reduction"),
    "sparse_gradients": (False, "FSDP2 reduces dense gradients"),
    "disable_allgather": (False, "FSDP2 always all-gathers parameters"),
    "use_data_before_expert_parallelism": (False, "qshard has no expert parallelism"),
}
# The top-level keys the reader reads (the sections it sorts key by key, and the values).
_TOP_MAPPED = (
    "zero_optimization",
    "optimizer",
    "bf16",
    "fp16",
    "amp",
    "torch_autocast",
    "activation_checkpointing",
    "data_types",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "communication_data_type",
)

# --- bf16, fp16, amp, torch_autocast, activation_checkpointing --------------------------------

_FP32_STATE = "qshard keeps fp32 master weights, gradients and optimizer state"
_BF16_NO_EQUIVALENT: dict[str, str] = {
    "immediate_grad_update": "FSDP2 writes reduced gradients as they arrive",
    "check_grad_overflow": "bf16 needs no loss scaling, so nothing to check",
}
_BF16_ONLY_DEFAULT: dict[str, tuple[Any, str]] = {
    "bf16_master_weights_and_grads": (False, _FP32_STATE),
    "bf16_optimizer_states": (
        False,
        f"{_FP32_STATE} (qshard.optim.AdamW8bit / AdamW4bit shrink the state)",
    ),
}
_FP16_NO_EQUIVALENT: dict[str, str] = dict.fromkeys(
    (
        "auto_cast",
        "loss_scale",
        "initial_scale_power",
        "loss_scale_window",
        "hysteresis",
        "consecutive_hysteresis",
        "min_loss_scale",
        "fp16_master_weights_and_grads",
    ),
    "read only when fp16 is enabled (it is not)",
)

# The keys DeepSpeed reads in its amp section (passed on to apex's amp.initialize) and its
# torch_autocast section: accepted, with no equivalent, while the section is disabled.
_DISABLED_SECTION_KEYS: dict[str, tuple[str, ...]] = {
    "amp": (
        "opt_level",
        "cast_model_type",
        "patch_torch_functions",
        "keep_batchnorm_fp32",
        "master_weights",
        "loss_scale",
        "cast_model_outputs",
        "num_losses",
        "verbosity",
        "min_loss_scale",
        "max_loss_scale",
    ),
    "torch_autocast": ("dtype", "lower_precision_safe_modules"),
}
# DeepSpeed's activation_checkpointing options: none has an equivalent (partition_activations
# and cpu_checkpointing are refused when on).
_ACTIVATION_CHECKPOINTING_KEYS = (
    "partition_activations",
    "cpu_checkpointing",
    "contiguous_memory_optimization",
    "number_checkpoints",
    "synchronize_checkpoint_boundary",
    "profile",
)

# --- "auto" values ----------------------------------------------------------------------------

# Where the Hugging Face Trainer takes an "auto" value from (transformers' HfTrainerDeepSpeedConfig).
_HF_AUTO_SOURCES = {
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "train_batch_size": (
        "per_device_train_batch_size x gradient_accumulation_steps x the number of ranks"
    ),
    "gradient_clipping": "max_grad_norm",
    "optimizer.params.lr": "learning_rate",
    "optimizer.params.betas": "[adam_beta1, adam_beta2]",
    "optimizer.params.eps": "adam_epsilon",
    "optimizer.params.weight_decay": "weight_decay",
    "bf16.enabled": "bf16 (true or false)",
    "fp16.enabled": "fp16 (true or false)",
}


def _auto_is_moot(path: str) -> bool:
    """Whether ``path`` names a key whose value qshard never reads (see [Note: "auto" values] in
    qshard.integrations.deepspeed)."""
    section, _, key = path.partition(".")
    if section in _TOP_NO_EQUIVALENT:
        return True
    if section == "zero_optimization" and "." not in key:
        return _ZERO_ALIASES.get(key, key) in _ZERO_NO_EQUIVALENT
    return False


def _is_default(value: Any, default: Any) -> bool:
    """Whether ``value`` is an only-default key's accepted ``default`` (``None``: absent, null
    or false)."""
    if default is None:
        return value is None or value is False
    if isinstance(default, bool):
        return value is default
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == default
    return value == default

"""DeepSpeed configs read into qshard (qshard.integrations.deepspeed) and `qshard train
--deepspeed-config`: every key mapped, recorded as having no equivalent, or refused by name;
DeepSpeed's defaults for absent keys; a round trip through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from qshard.integrations import deepspeed as ds
from qshard.integrations.deepspeed import DeepSpeedConfigError, read_deepspeed_config
from qshard.optim import OneBitAdam, ZeroOneAdam
from qshard.train.cli import config_from_args
from tests.train.test_train_e2e import _corpus_file

ZEROPP = {
    "train_batch_size": 8,
    "gradient_clipping": 0.5,
    "bf16": {"enabled": True},
    "communication_data_type": "fp32",
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1, "torch_adam": True},
    },
    "zero_optimization": {
        "stage": 3,
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": 2,
        "zero_quantized_gradients": True,
        "overlap_comm": False,
        "reduce_bucket_size": 5e8,
        "stage3_prefetch_bucket_size": 5e7,
        "stage3_max_live_parameters": 1e9,
        "offload_optimizer": {"device": "none"},
    },
    "steps_per_print": 10,
}

ZERO_ONE = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {
        "type": "ZeroOneAdam",
        "params": {
            "lr": 1e-3,
            "weight_decay": 0.01,
            "var_freeze_step": 40,
            "var_update_scaler": 8,
            "local_step_scaler": 20,
            "local_step_clipper": 4,
            "bias_correction": True,
            "cuda_aware": False,
            "comm_backend_name": "nccl",
        },
    },
}

# Every field (and stage-3 alias) of DeepSpeed 0.19.8's DeepSpeedZeroConfig.
DEEPSPEED_ZERO_KEYS = [
    "stage",
    "contiguous_gradients",
    "reduce_scatter",
    "reduce_bucket_size",
    "use_multi_rank_bucket_allreduce",
    "allgather_partitions",
    "allgather_bucket_size",
    "overlap_comm",
    "compute_grad_norm",
    "load_from_fp32_weights",
    "elastic_checkpoint",
    "offload_param",
    "offload_optimizer",
    "zenflow",
    "sub_group_size",
    "cpu_offload_param",
    "cpu_offload_use_pin_memory",
    "cpu_offload",
    "prefetch_bucket_size",
    "stage3_prefetch_bucket_size",
    "param_persistence_threshold",
    "stage3_param_persistence_threshold",
    "model_persistence_threshold",
    "stage3_model_persistence_threshold",
    "max_live_parameters",
    "stage3_max_live_parameters",
    "max_reuse_distance",
    "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save",
    "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold",
    "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params",
    "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential",
    "stage3_allgather_sequential",
    "stage3_gather_fp16_weights_on_model_save",
    "ignore_unused_parameters",
    "legacy_stage1",
    "round_robin_gradients",
    "parameter_alignment",
    "zero_hpz_partition_size",
    "zero_quantized_weights",
    "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients",
    "memory_efficient_linear",
    "pipeline_loading_checkpoint",
    "override_module_apply",
    "log_trace_cache_warnings",
    "enable_sanity_checks",
    "save_muon_momentum_buffer_in_memory",
    "leaf_module",
    "zeropp_loco_param",
    "mics_shard_size",
    "mics_hierarchical_params_gather",
]
# Every field of DeepSpeed's DeepSpeedBF16Config (0.19.5).
DEEPSPEED_BF16_KEYS = [
    "enabled",
    "immediate_grad_update",
    "check_grad_overflow",
    "bf16_master_weights_and_grads",
    "bf16_optimizer_states",
]


def test_zeropp_config_is_mapped():
    t = read_deepspeed_config(ZEROPP, ranks_per_node=2)
    z = t.zeropp
    assert (z.qwz, z.hpz, z.qgz, z.prefetch, z.wire_dtype) == (True, True, True, False, None)
    assert t.optimizer == "adamw" and t.optimizer_class is torch.optim.AdamW
    assert t.optimizer_kwargs == {
        "lr": 3e-4,
        "betas": (0.9, 0.95),
        "eps": 1e-8,  # DeepSpeed's default, filled in
        "weight_decay": 0.1,
    }
    assert t.mp_policy.param_dtype == torch.bfloat16
    assert t.mp_policy.reduce_dtype == torch.float32  # communication_data_type fp32
    assert (t.gradient_clipping, t.train_batch_size, t.hpz_partition_size) == (0.5, 8, 2)
    for key in (
        "zero_optimization.reduce_bucket_size",
        # the stage3_ aliases as the file spells them (they were listed under the field's
        # name, which a user searching the file did not find)
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_max_live_parameters",
        "optimizer.params.torch_adam",
        "steps_per_print",
    ):
        assert t.no_equivalent[key], key
    model = torch.nn.Linear(4, 4)
    assert isinstance(t.build_optimizer(model.parameters()), torch.optim.AdamW)


def test_deepspeed_defaults_for_absent_keys(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"optimizer": {"type": "Adam"}, "zero_optimization": {"stage": 3}}))
    t = read_deepspeed_config(path)
    # type Adam is AdamW in DeepSpeed unless adam_w_mode is false
    assert t.optimizer == "adamw"
    assert t.optimizer_kwargs == {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0}
    assert t.mp_policy is None and t.gradient_clipping == 0.0  # fp32, no clipping
    z = t.zeropp
    assert (z.qwz, z.hpz, z.qgz, z.prefetch) == (False, False, False, True)  # overlap_comm: on
    l2 = read_deepspeed_config({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}})
    assert l2.optimizer_class is torch.optim.Adam and l2.zeropp is None  # stage 0
    bf16 = read_deepspeed_config({"bf16": {"enabled": True}, "optimizer": {"type": "AdamW"}})
    assert bf16.mp_policy.reduce_dtype == torch.bfloat16  # DeepSpeed reduces bf16 in bf16
    # DeepSpeed lower-cases communication_data_type; "FP32" was refused as not fp32
    upper = read_deepspeed_config({"bf16": {"enabled": True}, "communication_data_type": "FP32"})
    assert upper.mp_policy.reduce_dtype == torch.float32
    assert upper.communication_data_type == "fp32"


def test_torch_adam_takes_torch_adamw_default_weight_decay():
    # DeepSpeed's torch_adam: true builds torch.optim.AdamW(**params): without a weight_decay
    # that is torch's default 0.01, not FusedAdam's 0.
    def kwargs(**params):
        cfg = {"optimizer": {"type": params.pop("type", "AdamW"), "params": params}}
        return read_deepspeed_config(cfg).optimizer_kwargs

    assert kwargs(torch_adam=True)["weight_decay"] == 0.01
    assert kwargs(type="Adam", torch_adam=True)["weight_decay"] == 0.01  # Adam is AdamW
    assert kwargs(torch_adam=True, weight_decay=0)["weight_decay"] == 0
    assert kwargs(type="Adam", torch_adam=True, adam_w_mode=False)["weight_decay"] == 0  # Adam
    assert kwargs(torch_adam=False)["weight_decay"] == 0  # FusedAdam's default
    assert kwargs()["weight_decay"] == 0


def test_batch_sizes_must_be_consistent():
    # DeepSpeed requires train_batch_size = micro batch x accumulation steps x world size.
    ok = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}
    t = read_deepspeed_config({**ok, "gradient_accumulation_steps": 4})
    assert (t.train_batch_size, t.micro_batch_size, t.gradient_accumulation_steps) == (16, 2, 4)
    for bad, what in (
        ({**ok, "gradient_accumulation_steps": 3}, "micro_batch_size_per_gpu 2 x gradient_acc"),
        (
            {**ok, "train_micro_batch_size_per_gpu": 3},
            "multiple of train_micro_batch_size_per_gpu 3:",
        ),
        ({"train_batch_size": 10, "gradient_accumulation_steps": 4}, "accumulation_steps 4:"),
    ):
        with pytest.raises(DeepSpeedConfigError, match=f"train_batch_size: .*{what}"):
            read_deepspeed_config(bad)


def test_one_bit_optimizers_are_mapped():
    t = read_deepspeed_config(ZERO_ONE)
    assert t.optimizer_class is ZeroOneAdam and t.zeropp is None
    assert t.optimizer_kwargs == {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.01,
        "var_freeze_step": 40,
        "var_update_scaler": 8,
        "local_step_scaler": 20,
        "local_step_clipper": 4,
    }
    assert "bias_correction" in t.no_equivalent["optimizer.params.bias_correction"]
    opt = t.build_optimizer(torch.nn.Linear(4, 4).parameters())  # no process group: one rank
    assert (opt.var_freeze_step, opt.local_step_clipper) == (40, 4)
    onebit = read_deepspeed_config({"optimizer": {"type": "OneBitAdam"}})
    assert onebit.optimizer_class is OneBitAdam
    assert onebit.optimizer_kwargs["freeze_step"] == 100_000  # DeepSpeed's default


def test_every_deepspeed_zero_key_is_handled():
    known = (
        set(ds._ZERO_MAPPED)
        | set(ds._ZERO_NO_EQUIVALENT)
        | set(ds._ZERO_ONLY_DEFAULT)
        | set(ds._ZERO_ALIASES)
    )
    assert sorted(set(DEEPSPEED_ZERO_KEYS) - known) == []


def test_deepspeed_defaults_of_unmapped_options_are_accepted():
    # At DeepSpeed's default these options change nothing; set, they are refused by name.
    zero = {"stage": 3, "mics_shard_size": -1, "mics_hierarchical_params_gather": False}
    bf16 = {"enabled": True, "bf16_master_weights_and_grads": False, "bf16_optimizer_states": False}
    t = read_deepspeed_config(
        {
            "zero_optimization": {**zero, "zeropp_loco_param": None},
            "bf16": bf16,
            "use_data_before_expert_parallelism": False,  # a top-level key of DeepSpeed's
        }
    )
    assert t.zeropp is not None and t.mp_policy.param_dtype == torch.bfloat16
    for key in DEEPSPEED_BF16_KEYS:  # every bf16 key is read (none refused as unknown)
        read_deepspeed_config({"bf16": {key: False}})
    for cfg, message in (
        ({"zero_optimization": {"stage": 3, "mics_shard_size": 8}}, "mics_shard_size: 8.*HSDP"),
        (
            {"zero_optimization": {"stage": 3, "zeropp_loco_param": {"err_beta": 0.8}}},
            "zeropp_loco_param.*no LoCo",
        ),
        ({"bf16": {"enabled": True, "bf16_optimizer_states": True}}, "fp32 master weights"),
        ({"bf16": {"bf16_master_weights_and_grads": True}}, "fp32 master weights"),
        ({"use_data_before_expert_parallelism": True}, "no expert parallelism"),
    ):
        with pytest.raises(DeepSpeedConfigError, match=message):
            read_deepspeed_config(cfg)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"zero_optimization": {"stage": 3, "zero_quantised_weights": True}}, "zero_quantised"),
        ({"optimizer": {"type": "AdamW"}, "train_batch_szie": 8}, "train_batch_szie"),
        ({"zero_optimization": {"stage": 2}}, "use stage 3"),
        ({"fp16": {"enabled": True}}, "fp16.enabled.*use bf16"),
        (
            {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}},
            "offload_optimizer.*no CPU/NVMe offload",
        ),
        ({"scheduler": {"type": "WarmupLR"}}, "scheduler.*learning-rate schedule"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, "params.lr.*auto"),
        ({"optimizer": {"type": "Lamb"}}, "'Lamb' has no qshard equivalent"),
        # a section without a type was "optimizer.type: None has no qshard equivalent"
        ({"optimizer": {"params": {"lr": 1e-3}}}, "optimizer.type: is missing: give the"),
        ({"optimizer": {"type": None}}, "optimizer.type: is missing"),
        ({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1}}}, "gradient_clipping"),
        (
            {"optimizer": {"type": "ZeroOneAdam"}, "zero_optimization": {"stage": 3}},
            "1-bit optimizers replicate the model",
        ),
        ({"optimizer": {"type": "OneBitAdam", "params": {"freeze_stpe": 5}}}, "freeze_stpe"),
        ({"zero_optimization": {"stage": 3, "reduce_scatter": False}}, "reduce_scatter"),
        ({"zero_optimization": {"zero_quantized_weights": True}}, "ZeRO\\+\\+ needs stage 3"),
        ({"prescale_gradients": True}, "prescale_gradients"),
        ({"activation_checkpointing": {"partition_activations": True}}, "partition"),
        # DeepSpeed's pydantic reads the string "false" as False; truthiness read it as True
        (
            {"zero_optimization": {"stage": 3, "overlap_comm": "false"}},
            "overlap_comm: must be true or false; got 'false'",
        ),
        ({"bf16": {"enabled": "false"}}, "bf16.enabled: must be true or false"),
        ({"fp16": {"enabled": "false"}}, "fp16.enabled: must be true or false"),
        ({"torch_autocast": {"enabled": "false"}}, "torch_autocast.enabled: must be true or"),
        ({"optimizer": {"type": "AdamW", "params": [["lr", 1e-3]]}}, "params: must be a JSON"),
        ({"gradient_clipping": float("nan")}, "gradient_clipping: must be a finite number"),
        ({"gradient_clipping": float("inf")}, "0: no clipping"),
        # a falsy non-object section was read as absent (stage 0, no optimizer, fp32); the
        # ZeRO section's booleans are DeepSpeed's old form (test_inputs_a_first_user_...)
        ({"zero_optimization": []}, "zero_optimization: must be a JSON object"),
        ({"optimizer": []}, "optimizer: must be a JSON object"),
        ({"bf16": 0}, "bf16: must be a JSON object; got 0"),
        # a typo in a disabled amp / torch_autocast section was listed as having no equivalent
        ({"amp": {"enabled": False, "opt_levle": "O1"}}, "amp.opt_levle: is not an option"),
        ({"torch_autocast": {"enabled": False, "dtpye": "bf16"}}, "torch_autocast.dtpye"),
        # values torch's optimizers refuse: named by key here, not by build_optimizer (or, in
        # qshard train, by a --beta2 / --lr / --weight-decay flag the user never gave)
        (
            {"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.0]}}},
            r"params.betas: must both be in \[0, 1\); got \[0.9, 1.0\]",
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"betas": [True, 0.9]}}},
            "params.betas: must be two numbers",  # a bool read as beta1 = 1.0
        ),
        ({"optimizer": {"type": "Adam", "params": {"lr": -1e-3}}}, "params.lr: must be >= 0"),
        (
            {"optimizer": {"type": "OneBitAdam", "params": {"weight_decay": -0.1}}},
            "params.weight_decay: must be >= 0; got -0.1",
        ),
        ({"optimizer": {"type": "AdamW", "params": {"eps": -1e-8}}}, "params.eps: must be >= 0"),
        # the string "false" is truthy: adam_w_mode read it as AdamW, torch_adam as on (0.01
        # decay), partition_activations as on (refused for partitioning)
        (
            {"optimizer": {"type": "Adam", "params": {"adam_w_mode": "false"}}},
            "params.adam_w_mode: must be true or false; got 'false'",
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"torch_adam": "false"}}},
            "params.torch_adam: must be true or false; got 'false'",
        ),
        (
            {"activation_checkpointing": {"partition_activations": "false"}},
            "partition_activations: must be true or false",
        ),
        # a falsy non-object optimizer.params was read as absent (every DeepSpeed default)
        ({"optimizer": {"type": "AdamW", "params": []}}, "params: must be a JSON object; got"),
        ({"optimizer": {"type": "AdamW", "params": False}}, "params: must be a JSON object"),
        # a typo in a disabled (device "none") offload section was accepted unread
        (
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_optimizer": {"device": "none", "pin_memroy": True},
                }
            },
            "offload_optimizer.pin_memroy: is not an option",
        ),
        # "auto" in a key qshard reads names where the Trainer would take it from
        ({"train_batch_size": "auto"}, "train_batch_size: .*per_device_train_batch_size"),
        ({"gradient_clipping": "auto"}, "gradient_clipping: .*max_grad_norm"),
        ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel: qshard has no tensor"),
    ],
)
def test_refused_keys_are_named(config, message):
    with pytest.raises(DeepSpeedConfigError, match=message):
        read_deepspeed_config(config)


def test_hugging_face_zero3_config_with_auto_in_unread_keys():
    # The Trainer's stock ZeRO-3 file (transformers' DeepSpeed docs), with the values qshard
    # reads filled in: the "auto" left in keys with no equivalent is never read, so it is
    # accepted and listed, not refused as if it mattered.
    cfg = {
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "legacy_fusion": False, "params": {"lr": 2e-5}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "none", "pin_memory": True},
            "offload_param": {"device": "none", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "sub_group_size": 1e9,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": "auto",
        },
        "gradient_clipping": 1.0,
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 2000,
        "wall_clock_breakdown": False,
        "comms_logger": {"enabled": False},
    }
    t = read_deepspeed_config(cfg)
    assert t.zeropp is not None and t.mp_policy.param_dtype == torch.bfloat16
    for key in (
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.stage3_prefetch_bucket_size",  # as the file spells them
        "zero_optimization.stage3_param_persistence_threshold",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        "optimizer.legacy_fusion",
        "comms_logger",
    ):
        assert t.no_equivalent[key], key
    cfg["optimizer"]["params"]["lr"] = "auto"  # a value qshard reads: still refused
    with pytest.raises(DeepSpeedConfigError, match=r"params\.lr: .*TrainingArguments learning_r"):
        read_deepspeed_config(cfg)


def test_hpz_partition_size_must_be_the_node():
    cfg = {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}}
    with pytest.raises(DeepSpeedConfigError, match="one node \\(4 ranks\\); set 4"):
        read_deepspeed_config(cfg, ranks_per_node=4)
    with pytest.raises(DeepSpeedConfigError, match=r"set 1 \(hpZ off\).*--ranks-per-node 8"):
        read_deepspeed_config(cfg, ranks_per_node=1)
    # Without ranks_per_node the size cannot be checked: said (it was dropped without a word,
    # shard() sizing hpZ by the topology's node whatever the file said).
    with pytest.warns(UserWarning, match="zero_hpz_partition_size 8 is not checked") as got:
        assert read_deepspeed_config(cfg).hpz_partition_size == 8
    assert got[0].filename == __file__  # the caller's line, not a frame inside qshard
    amp = read_deepspeed_config({"amp": {"enabled": False, "opt_level": "O1"}})
    assert "amp.opt_level" in amp.no_equivalent
    assert read_deepspeed_config(cfg, ranks_per_node=8).zeropp.hpz


# What DeepSpeed's tutorial-style files look like on disk: DeepSpeed reads them with hjson, so
# they carry comments and trailing commas.
COMMENTED = """{
  // ZeRO++ on 8 GPUs a node
  "train_micro_batch_size_per_gpu": 4,  # per rank
  "bf16": {"enabled": true},
  "communication_data_type": "fp32",
  /* a block comment, with a "quote" and a , before } */
  "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95,],},},
  "zero_optimization": {
    "stage": 3,
    "zero_quantized_weights": true,
    "zero_hpz_partition_size": 8,
    "zero_quantized_gradients": true,
    "reduce_bucket_size": "http://not-a-comment.example/#x",
  },
}
"""


def test_files_with_comments_and_trailing_commas_are_read(tmp_path):
    # They were refused ("Expecting property name enclosed in double quotes") though DeepSpeed
    # (hjson) reads them; comments and trailing commas inside strings stay as they are.
    path = tmp_path / "ds_config.json"
    path.write_text(COMMENTED)
    t = read_deepspeed_config(path, ranks_per_node=8)
    assert (t.zeropp.qwz, t.zeropp.hpz, t.zeropp.qgz) == (True, True, True)
    assert t.optimizer_kwargs["betas"] == (0.9, 0.95) and t.micro_batch_size == 4
    assert "zero_optimization.reduce_bucket_size" in t.no_equivalent
    # an escaped backslash ends its string: the comment after it is one
    assert ds._strip_comments('{"a": "x // y, ]", "b": "\\\\" // c\n}') == (
        '{"a": "x // y, ]", "b": "\\\\"     \n}'
    )
    path.write_text('{\n  zero_optimization: {"stage": 3}\n}')  # Hjson's unquoted key
    with pytest.raises(DeepSpeedConfigError, match=r"line 2 column 3 .*quote every key"):
        read_deepspeed_config(path)


def test_duplicate_keys_are_refused(tmp_path):
    # json keeps the last of two equal keys: the first was dropped without a word (here qwZ
    # turned off), where DeepSpeed refuses the file.
    path = tmp_path / "ds.json"
    path.write_text(
        '{"zero_optimization": {"stage": 3, "zero_quantized_weights": true, '
        '"zero_quantized_weights": false}}'
    )
    with pytest.raises(DeepSpeedConfigError, match="'zero_quantized_weights' is given twice"):
        read_deepspeed_config(path)


def test_inputs_a_first_user_got_wrong_are_named():
    # Neither a dict nor a path: a raw TypeError from pathlib before.
    for source in ([{"train_batch_size": 8}], 5, None):
        with pytest.raises(DeepSpeedConfigError, match="takes a dict or the path of a JSON file"):
            read_deepspeed_config(source)
    # DeepSpeed's old boolean form of the ZeRO section: false is stage 0 (it was refused as
    # "must be a JSON object"), true stage 1 (refused as stage 1 is).
    off = read_deepspeed_config({"zero_optimization": False, "optimizer": {"type": "OneBitAdam"}})
    assert off.zeropp is None and off.optimizer == "onebit_adam"
    with pytest.raises(DeepSpeedConfigError, match="true is DeepSpeed's old form of stage 1"):
        read_deepspeed_config({"zero_optimization": True})
    # A quoted switch names JSON true/false (amsgrad's said "set it to false" of "false"), and
    # is checked at stage 0 too (overlap_comm "true" passed there, refused at stage 3).
    adam = {"type": "AdamW", "params": {"amsgrad": "false"}}
    with pytest.raises(DeepSpeedConfigError, match=r"amsgrad: must be true or false.*without"):
        read_deepspeed_config({"optimizer": adam, "zero_optimization": {"stage": 3}})
    null = {"type": "AdamW", "params": {"amsgrad": None}}  # null: absent, as elsewhere
    assert read_deepspeed_config({"optimizer": null}).optimizer == "adamw"
    for stage in (0, 3):
        with pytest.raises(DeepSpeedConfigError, match=r"overlap_comm: must be true or false"):
            read_deepspeed_config({"zero_optimization": {"stage": stage, "overlap_comm": "true"}})


def test_whole_numbers_written_as_floats_are_ints():
    # 1e5 and 8.0 are read as floats by JSON; DeepSpeed takes them as the integers (pydantic's
    # int fields, the 1-bit optimizers' step comparisons). They were refused ("must be an int").
    t = read_deepspeed_config(
        {
            "train_batch_size": 32.0,
            "train_micro_batch_size_per_gpu": 4.0,
            "optimizer": {"type": "OneBitAdam", "params": {"freeze_step": 1e5}},
        }
    )
    assert t.optimizer_kwargs["freeze_step"] == 100_000
    assert type(t.optimizer_kwargs["freeze_step"]) is int
    assert (t.train_batch_size, t.micro_batch_size) == (32, 4)
    z = read_deepspeed_config(
        {"zero_optimization": {"stage": 3.0, "zero_hpz_partition_size": 8.0}}, ranks_per_node=8
    )
    assert z.zeropp.hpz and z.hpz_partition_size == 8
    for bad, message in (
        ({"train_batch_size": 32.5}, "train_batch_size: must be an int >= 1; got 32.5"),
        ({"zero_optimization": {"stage": 2.5}}, "stage: must be 0, 1, 2 or 3; got 2.5"),
        ({"zero_optimization": {"stage": True}}, "stage: must be 0, 1, 2 or 3; got True"),
        (
            {"optimizer": {"type": "ZeroOneAdam", "params": {"var_freeze_step": 10.5}}},
            "var_freeze_step: must be an int >= 1; got 10.5",
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"lr": "3e-4"}}},
            r"lr: must be a number; got '3e-4' \(write it without quotes\)",
        ),
    ):
        with pytest.raises(DeepSpeedConfigError, match=message):
            read_deepspeed_config(bad)


@pytest.mark.parametrize(
    ("kind", "said"),
    [
        ("WarmupLR", r"from warmup_min_lr \(default 0\) .*logarithmically .*then holds it"),
        ("WarmupDecayLR", r"logarithmically .*then decays it linearly to 0 at total_num_steps"),
        ("WarmupCosineLR", r"ratio rising .*cos_min_ratio \(default 0.0001\)"),
        ("OneCycle", "cycles the lr"),
        ("MyOwn", r"^the DeepSpeed config: scheduler: qshard does not own"),
    ],
)
def test_a_scheduler_is_refused_saying_what_deepspeed_computes(kind, said):
    # The Trainer's stock files fill the scheduler with "auto": that was refused first ("give
    # the value here"), and the scheduler only after the user had filled every one in.
    auto = {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}
    cfg = {"scheduler": {"type": kind, "params": auto}, "zero_optimization": {"stage": 3}}
    with pytest.raises(DeepSpeedConfigError, match=said) as info:
        read_deepspeed_config(cfg)
    assert "remove the section" in str(info.value) and "auto" not in str(info.value)


def _write(tmp_path, cfg) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_cli_takes_the_file_and_refuses_conflicts(tmp_path):
    path = _write(tmp_path, ZEROPP)
    base = ["--deepspeed-config", path, "--nproc", "4", "--ranks-per-node", "2"]
    cfg = config_from_args(base)
    assert (cfg.zeropp, cfg.optim, cfg.lr, cfg.beta2) == ("qwz,hpz,qgz", "adamw", 3e-4, 0.95)
    assert (cfg.weight_decay, cfg.grad_clip, cfg.dtype, cfg.batch_size) == (0.1, 0.5, "bf16", 8)
    assert config_from_args([*base, "--lr", "3e-4"]).lr == 3e-4  # the same value: fine
    with pytest.raises(
        ValueError,
        match=r"--lr 0.001 conflicts with .*ds.json, which sets 0.0003 \(its optimizer.params.lr\)",
    ):
        config_from_args([*base, "--lr", "1e-3"])
    # A value the file does not write is DeepSpeed's default, and the error says so (it said
    # "which sets 0.0" of a file without gradient_clipping).
    (tmp_path / "bare").mkdir()
    bare = ["--deepspeed-config", _write(tmp_path / "bare", {"zero_optimization": {"stage": 3}})]
    with pytest.raises(
        ValueError,
        match=r"--grad-clip 1.0 conflicts with .*, which sets 0.0 \(its gradient_clipping; 0.0, "
        r"no clipping, where the key is absent\)",
    ):
        config_from_args([*bare, "--grad-clip", "1.0"])
    with pytest.raises(ValueError, match=r"which sets fp32 \(bf16 when its bf16 section is"):
        config_from_args([*bare, "--dtype", "bf16"])
    with pytest.raises(ValueError, match="--zeropp off conflicts"):
        config_from_args([*base, "--zeropp", "off"])
    for same in ("all", "qgz,hpz,qwz"):  # the file's features named otherwise: no conflict
        assert config_from_args([*base, "--zeropp", same]).zeropp_features == {"qwz", "hpz", "qgz"}
    with pytest.raises(ValueError, match="--zeropp qwz,hpz conflicts"):
        config_from_args([*base, "--zeropp", "qwz,hpz"])
    assert config_from_args([*base, "--optim", "adamw8bit"]).optim == "adamw8bit"  # the swap
    # the file's lr is the schedule's peak: the default floor follows it (a fine-tuning lr
    # below the app's default --min-lr 3e-4 was refused, naming a flag never given)
    (tmp_path / "low").mkdir()
    low_lr = {**ZEROPP, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    low = ["--deepspeed-config", _write(tmp_path / "low", low_lr), *base[2:]]
    assert config_from_args(low).min_lr == pytest.approx(1e-5)
    assert config_from_args([*low, "--min-lr", "0"]).min_lr == 0  # given: kept
    with pytest.raises(ValueError, match=r"--min-lr 0\.0003 must not exceed --lr 0\.0001"):
        config_from_args([*low, "--min-lr", "3e-4"])
    with pytest.raises(
        ValueError,
        match=r"one node \(1 rank\); set 1 \(hpZ off\).*--ranks-per-node 2 with --nproc a "
        r"multiple of 2\)",
    ):
        config_from_args([*base[:-1], "1"])
    for change, message in (
        (
            {"gradient_accumulation_steps": 3},  # train_batch_size 8: not 3 x 4 ranks' share
            r"ds.json: train_batch_size: 8 is not a multiple of gradient_accumulation_steps 3",
        ),
        ({"communication_data_type": "bf16"}, "communication_data_type"),
        ({"zero_optimization": {"stage": 0}}, "plain data parallel"),
        # Said of the file's keys; they were "--batch-size 6 must be divisible by the number
        # of ranks 4; e.g. --batch-size 4" (a flag that then conflicts with the file) and
        # "--lr must be > 0".
        (
            {"train_batch_size": 6},
            r"ds.json: train_batch_size: 6 does not split evenly over 4 ranks .*set a multiple "
            r"of 4 \(e.g. 4\), or run on --nproc 3",
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"lr": 0}}},
            r"ds.json: optimizer.params.lr: 0.0: qshard train needs a peak lr > 0",
        ),
    ):
        with pytest.raises(DeepSpeedConfigError, match=message):
            config_from_args(["--deepspeed-config", _write(tmp_path, {**ZEROPP, **change})])


def test_cli_file_without_an_optimizer_section_keeps_the_optim_flag(tmp_path):
    """docs/deepspeed.md: flags the file does not speak to keep theirs. A file with no
    optimizer section (stage 0, or nothing but a batch size) was refused as "stage 0 with
    Adam/AdamW ... set stage 3" whatever --optim said, naming an optimizer the file never
    chose; a 1-bit --optim runs at stage 0, with the app's run-sized schedule."""
    from qshard.train._parallel import build_optimizer
    from qshard.train.model import GPT, GPTConfig

    (tmp_path / "z0").mkdir()
    (tmp_path / "b").mkdir()
    stage0 = _write(tmp_path / "z0", {"zero_optimization": {"stage": 0}})
    only_batch = _write(tmp_path / "b", {"train_batch_size": 4})
    for path in (stage0, only_batch):
        for optim in ("onebit_adam", "zero_one_adam"):
            argv = ["--deepspeed-config", path, "--nproc", "2", "--optim", optim, "--steps", "40"]
            cfg = config_from_args(argv)
            assert (cfg.optim, cfg.zeropp) == (optim, "off")
        with pytest.raises(DeepSpeedConfigError) as refused:
            config_from_args(["--deepspeed-config", path, "--nproc", "2"])
        message = str(refused.value)
        assert message.startswith(f"{path}: zero_optimization.stage: 0 (also what no ")
        assert "with --optim adamw8bit (its default; the file has no optimizer section)" in message
        assert "Adam/AdamW" not in message
        assert message.endswith(
            'set "zero_optimization": {"stage": 3}, or pass --optim onebit_adam or zero_one_adam '
            "(the 1-bit optimizers run replicated, at stage 0)"
        )
    with pytest.raises(DeepSpeedConfigError, match=r"with --optim adamw \(the file has no"):
        config_from_args(["--deepspeed-config", stage0, "--nproc", "2", "--optim", "adamw"])
    # the file's own optimizer is named as the file's
    adamw0 = _write(tmp_path, {"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 0}})
    with pytest.raises(
        DeepSpeedConfigError,
        match=r"with the file's optimizer adamw is plain .*"
        r"set optimizer.type OneBitAdam or ZeroOneAdam",
    ):
        config_from_args(["--deepspeed-config", adamw0, "--nproc", "2"])
    # a stage-3 file and a 1-bit --optim: the file's stage went unused (the run was replicated)
    stage3 = _write(tmp_path, {"zero_optimization": {"stage": 3}})
    with pytest.raises(
        DeepSpeedConfigError,
        match=r"zero_optimization.stage: 3 with --optim "
        r"onebit_adam \(the file has no optimizer section\): the 1-bit",
    ):
        config_from_args(["--deepspeed-config", stage3, "--nproc", "2", "--optim", "onebit_adam"])
    # the file has no schedule: the app's run-sized one, not the class's 10^5-step default
    argv = ["--deepspeed-config", stage0, "--nproc", "2", "--optim", "onebit_adam"]
    cfg = config_from_args([*argv, "--steps", "40"])
    opt = build_optimizer(GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, context=8)), cfg)
    assert opt.freeze_step == 10  # a quarter of the run


def test_cli_zero_one_adam_schedule_from_the_file(tmp_path):
    from qshard.train._parallel import build_optimizer
    from qshard.train.model import GPT, GPTConfig

    cfg = config_from_args(["--deepspeed-config", _write(tmp_path, ZERO_ONE), "--nproc", "2"])
    assert (cfg.optim, cfg.zeropp, cfg.batch_size, cfg.grad_clip) == ("zero_one_adam", "off", 4, 0)
    opt = build_optimizer(GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, context=8)), cfg)
    assert (opt.var_freeze_step, opt.var_update_scaler) == (40, 8)  # the file's, not the app's
    assert (opt.local_step_scaler, opt.local_step_clipper) == (20, 4)


def test_cli_takes_bf16_of_a_replicated_one_bit_run(tmp_path):
    # Stage 0 keeps the model replicated, outside FSDP2's mixed precision: the app computes it
    # under autocast (tests/train/test_train_e2e.py checks the losses are bf16 ones).
    cfg = {**ZERO_ONE, "bf16": {"enabled": True}, "communication_data_type": "fp32"}
    config = config_from_args(["--deepspeed-config", _write(tmp_path, cfg), "--nproc", "2"])
    assert (config.dtype, config.optim, config.zeropp) == ("bf16", "zero_one_adam", "off")


def test_qshard_train_round_trip(tmp_path):
    """`qshard train --deepspeed-config` on 2 ranks: the run is the file's ZeRO++ and AdamW."""
    _corpus_file(tmp_path)
    cfg = {
        "train_batch_size": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95]}},
        "zero_optimization": {
            "stage": 3,
            "zero_quantized_weights": True,
            "zero_quantized_gradients": True,
        },
    }
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "qshard.cli", "train", "--deepspeed-config"]
    cmd += [_write(tmp_path, cfg), "--nproc", "2", "--ranks-per-node", "1", "--steps", "3"]
    cmd += ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--context", "32"]
    cmd += ["--warmup-steps", "1", "--eval-interval", "0", "--no-export", "--no-progress"]
    cmd += ["--data", str(tmp_path / "corpus.txt"), "--cache-dir", str(tmp_path / "cache")]
    cmd += ["--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    saved = json.loads((out / "config.json").read_text())
    assert (saved["zeropp"], saved["optim"], saved["lr"]) == ("qwz,qgz", "adamw", 2e-3)
    assert (saved["batch_size"], saved["weight_decay"], saved["dtype"]) == (2, 0.0, "fp32")
    assert "FSDP2 + ZeRO++ (qgz, qwz)" in proc.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert "grad_reduce_scatter/all_to_all" in records[0]["ledger"]  # qgZ's two hops
    bad = subprocess.run(
        [*cmd[:5], cmd[5], "--lr", "1e-2", "--out", str(tmp_path / "bad")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert bad.returncode == 2 and "--lr 0.01 conflicts with" in bad.stderr


def test_step_in_backward_with_a_clipping_file_names_the_files_key(tmp_path):
    """--step-in-backward cannot clip; with a file that clips, "pass --grad-clip 0" was then
    refused as a conflict with the file."""
    path = _write(tmp_path, ZEROPP)  # gradient_clipping 0.5
    with pytest.raises(ValueError) as info:
        config_from_args(["--deepspeed-config", path, "--nproc", "4", "--step-in-backward"])
    assert f'set "gradient_clipping": 0 in {path}, or drop --step-in-backward' in str(info.value)
    no_clip = _write(tmp_path, {**ZEROPP, "gradient_clipping": 0})
    cfg = config_from_args(["--deepspeed-config", no_clip, "--nproc", "4", "--step-in-backward"])
    assert cfg.step_in_backward and cfg.grad_clip == 0

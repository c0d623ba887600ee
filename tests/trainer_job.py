"""transformers' ``Trainer`` on a tiny saved Llama, as a user runs it, with and without
``fuse_lm_head``; launched by the tests as users launch a training script::

    python -m torch.distributed.run --nproc-per-node 4 -m tests.trainer_job MODEL OUT tp=4 tp=2,fsdp=2

Each ``tp=T[,fsdp=F]`` is a layout: the model is loaded with transformers' own
``DistributedConfig(tp_size=T, fsdp_size=F)`` (so ``model._tp_size`` is T, and the Trainer
builds accelerate's ``ParallelismConfig`` from it), then trained for ``STEPS`` optimizer
steps of ``ACCUMULATE`` micro-batches, once per arm (transformers' own loss on its
gathered logits, and ``fuse_lm_head``) and per ``average_tokens_across_devices``. Every
rank writes ``OUT/rank<r>.pt``: per run, the logged ``(loss, grad_norm)`` of each step and,
on rank 0, every weight afterwards (DTensors gathered). ``train`` also gives the
one-process reference, run by the test itself.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

ROWS, LENGTH, STEPS, ACCUMULATE, BATCH = 16, 7, 2, 2, 2
ARMS = ("transformers", "vtp")


def rows(vocab_size: int) -> list[dict[str, list[int]]]:
    """Token rows whose first 1 to 4 labels are -100 (prompts of different lengths), so that
    the micro-batches count different numbers of tokens."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(ROWS):
        ids = torch.randint(0, vocab_size, (LENGTH,), generator=g)
        labels = ids.clone()
        labels[: int(torch.randint(1, 5, (), generator=g))] = -100
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


def train(model, out_dir: str, average: bool = True, batch: int = BATCH) -> dict[str, Any]:
    """Train ``model`` with the Trainer (a model, or a function that builds one: the
    Trainer's ``model_init``); its logs and its weights afterwards (full tensors)."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=ACCUMULATE,
        max_steps=STEPS,
        logging_steps=1,
        # plain SGD, gradients not clipped (only measured): the weights move by lr × the
        # gradient, so its errors show in them, its scale too (AdamW's steps and clipping hide a scale)
        optim="sgd",
        learning_rate=0.1,
        max_grad_norm=1e3,
        average_tokens_across_devices=average,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    init = None if isinstance(model, torch.nn.Module) else model
    trainer = Trainer(model=None if init else model, model_init=init, args=args)
    built: Any = trainer.model
    trainer.train_dataset = Dataset.from_list(rows(built.config.vocab_size))
    trainer.train()
    trained: Any = trainer.model  # with model_init, built again by train()
    logs = [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e]
    weights = {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in trained.named_parameters()
    }
    return {"logs": logs, "weights": weights}


def _layout(spec: str) -> dict[str, int]:
    return {k: int(v) for k, v in (part.split("=") for part in spec.split(","))}


def main(path: str, out: str, *layouts: str) -> None:
    import torch.distributed as dist
    from accelerate.state import AcceleratorState
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    import vtp_runtime as vtp
    from vtp_runtime.integrations.transformers import fuse_lm_head
    from vtp_runtime.testing.launch import accelerate_tensor_parallel_on_cpu

    results: dict[str, Any] = {}
    with accelerate_tensor_parallel_on_cpu(), vtp.use_backend("eager"):
        for spec in layouts:
            layout = _layout(spec)
            config = DistributedConfig(tp_size=layout["tp"], fsdp_size=layout.get("fsdp"))
            for arm in ARMS:
                for average in (True, False):
                    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, distributed_config=config)
                    assert model._tp_size == layout["tp"], model._tp_size  # as transformers sets it
                    if arm == "vtp":
                        fuse_lm_head(model)
                    name = f"{spec} {arm} average={average}"
                    results[name] = train(model, f"{out}/{name}", average)
                    AcceleratorState._reset_state()  # the next run may have another mesh
    rank = dist.get_rank()
    if rank != 0:
        for run in results.values():
            del run["weights"]
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])

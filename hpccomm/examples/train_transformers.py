"""The transformers Trainer on hpccomm: hpccomm's process group first, then
``TrainingArguments(use_cpu=True)``.

    mpirun -n 4 python -m hpccomm.examples.train_transformers

Needs transformers and Accelerate (hpccomm's ``frameworks`` extra: the
versions tested).  The Trainer cannot be given the backend's name:
``--ddp_backend hpccomm`` is refused by its argument parser (``invalid
choice: 'hpccomm' (choose from 'nccl', 'gloo', 'mpi', ...)``) and
``TrainingArguments(ddp_backend="hpccomm")`` fails in Accelerate under it
(``ValueError: Your assigned backend hpccomm is not available, please use
gloo``).  It sets up distributed training through Accelerate, which uses a
process group that is already there: ``hpccomm.init_process_group()`` first,
then ``use_cpu=True`` (without it, on a machine without GPUs, every rank
trains alone, silently).

Builds a tiny GPT-2 from a config (nothing downloaded: run with
``HF_HUB_OFFLINE=1`` where there is no network), trains it one epoch on
synthetic token sequences with plain SGD (the Trainer's default gradient
clipping kept) and checks, on every rank: the backend (the default group's
and DDP's) is hpccomm, the Trainer counts the job's processes, the weights
equal a one-process run on the world's batches and are identical on every
rank.
"""
from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist

import hpccomm

from ._common import output_is_terminal, run
from ._frameworks import BATCH, LR, STEPS, global_batches, verify

VOCAB, LENGTH = 64, 12


def token_data(size: int):
    """``(input_ids, labels)``: ``size * BATCH * STEPS`` random sequences, the
    same on every rank.  The labels are the tokens, less the first: no token
    predicts it, and so every count of the tokens with a label agrees (the
    Trainer divides the summed loss by the labels it counts before the shift,
    one per token: with a first label, by 12 per sequence where 11 are
    predicted)."""
    gen = torch.Generator().manual_seed(4321)
    tokens = torch.randint(0, VOCAB, (size * BATCH * STEPS, LENGTH), generator=gen)
    labels = tokens.clone()
    labels[:, 0] = -100  # ignored by the loss
    return tokens, labels


def main() -> int:
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    def gpt2():
        config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=16, n_layer=2, n_head=2,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        torch.manual_seed(0)  # the same initial weights on every rank and in the reference
        return GPT2LMHeadModel(config)

    hpccomm.init_process_group()            # before the Trainer's Accelerate looks for a process group
    size = dist.get_world_size()
    tokens, labels = token_data(size)
    data = [{"input_ids": t, "labels": y} for t, y in zip(tokens, labels)]
    model = gpt2()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, use_cpu=True,   # use_cpu: else no distributed training without GPUs
            per_device_train_batch_size=BATCH, num_train_epochs=1, train_sampling_strategy="sequential",
            lr_scheduler_type="constant", ddp_find_unused_parameters=False, report_to="none",
            save_strategy="no", logging_strategy="no", disable_tqdm=not output_is_terminal())
        trainer = Trainer(model=model, args=args, train_dataset=data,
                          optimizers=(torch.optim.SGD(model.parameters(), lr=LR), None))
        trainer.train()

    # one process on the world's batches, as the Trainer steps: the loss's mean over every labelled token
    # of the world's batch, the gradient clipped to the Trainer's max_grad_norm
    reference = gpt2()
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for batch, batch_labels in global_batches([tokens, labels], size):
        opt.zero_grad()
        reference(input_ids=batch, labels=batch_labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), args.max_grad_norm)
        opt.step()
    return verify("train_transformers", f"transformers {transformers.__version__}", model, reference,
                  trainer.model_wrapped, args.world_size,
                  extra=[(trainer.state.global_step == STEPS,
                          f"{trainer.state.global_step} steps, expected {STEPS}")])


if __name__ == "__main__":
    run(main)

"""The trainer's `--help`: the words for each trainer setting (`TRAIN_HELP`), the formatter that
appends defaults, and the epilog listing the settings (`train.cli`)."""

import argparse
import dataclasses
import textwrap

from .settings import TrainConfig

# --help's words for the trainer settings (`TrainConfig`; the defaults come from it)
TRAIN_HELP = {
    "batch_size": "global batch, in sequences per step (per micro-batch with grad_accum)",
    "grad_accum": "micro-batches of batch_size per optimizer step, gradients summed in "
    "float32 (train/accumulate.py)",
    "seq_len": "tokens per sequence",
    "lr": "peak learning rate (AdamW)",
    "min_lr_ratio": "the cosine decays to lr * this",
    "warmup_steps": "steps of linear warmup from 0",
    "schedule_steps": "the cosine schedule's horizon in steps (unset: --steps)",
    "weight_decay": "AdamW weight decay (never on 1-D parameters)",
    "clip_norm": "global gradient-norm clipping",
    "b1": "AdamW beta1",
    "b2": "AdamW beta2",
    "seed": "initialisation and data-order seed",
    "save_every": "checkpoint every N steps (and at the last step)",
    "synthetic": "train on a learnable synthetic stream instead of text files",
    "mesh": "device mesh, e.g. data=2,expert=4 or node=2,expert=8 (axes data, fsdp, node, "
    "expert, context, expert_tensor; one size may be -1)",
    "compute_dtype": "float32 or bfloat16 (float32 master weights and optimizer either way)",
    "loss_chunk": "tokens per device per LM-head / cross-entropy chunk",
    "offload_optimizer": "float32 weights and AdamW moments in pinned host memory between "
    "steps, streamed layer by layer (needs scan_layers=true; docs/planning.md)",
    "eval_every": "with --eval-data: evaluate every N steps and at the last step (unset: the "
    "last step only)",
    "eval_batches": "with --eval-data: batches of batch_size rows per evaluation (the same rows "
    "each time)",
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description and epilog as written; each optional flag's default appended to its help
    (none, off for a switch, or the value) unless the help already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (
            not action.option_strings
            or action.required
            or "default" in text
            or action.default is argparse.SUPPRESS
        ):
            return text
        if action.default is None or action.default == []:
            return text + " (default: none)"
        if action.default is False:
            return text + " (default: off)"
        return text + " (default: %(default)s)"


def trainer_settings_help() -> str:
    rows = []
    for f in dataclasses.fields(TrainConfig):
        default = "unset" if f.default is None else f.default
        rows.append(
            textwrap.fill(
                TRAIN_HELP.get(f.name, ""),
                96,
                initial_indent=f"  {f.name}={default}".ljust(26) + " ",
                subsequent_indent=" " * 27,
            )
        )
    notes = (
        "Any other key=value sets a field of the model config (the YAML keys of "
        "configs/*.yaml, e.g. dispatcher=alltoall routing=token capacity_factor=1.0). "
        "Exit status: 0 done; 1 an error, said in one line on stderr; 2 bad arguments; "
        "130 / 143 stopped by SIGINT / SIGTERM (after checkpointing the last completed "
        "step: rerun the same command to resume; a second signal stops at once, without "
        "saving the step in progress, unless a checkpoint is being written)."
    )
    return (
        "trainer settings, as key=value or --key VALUE (shown with their defaults):\n"
        + "\n".join(rows)
        + "\n\n"
        + textwrap.fill(notes, 98)
    )

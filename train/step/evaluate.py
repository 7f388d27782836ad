"""Held-out evaluation: `--eval-data DIR` (a prepared dataset, `relaymoe-train prepare`) with
`eval_every=N` and `eval_batches=K` (`train.settings.TrainConfig`).

The evaluation rows are read once, at the start: the first K global batches of `batch_size` rows
of seq_len that the loader (`train.data.loader.PackedRows`) gives for the fixed seed `EVAL_SEED`
(the dataset's rows in that seed's shuffle: K * batch_size distinct rows, the same in every run
and on resume, whatever the training seed). Each process reads only the rows its devices hold and
puts them on the train step's batch sharding (`train_step.put_batch`); they stay on the device.
With `grad_accum=N` a batch is a micro-batch of `batch_size` rows, the step's batch sharding's.

Every `eval_every` steps and at the last step, `Evaluator` runs the model on those rows with the
train step's own loss terms (`objective.make_terms`: the same cast, chunked LM head, masks)
compiled as a separate forward-only program: it takes the state's parameters and other variables
on their shardings (with `offload_optimizer`, fetched from host memory as the step fetches them),
donates nothing and changes nothing. It returns each batch's summed next-token loss and its count
of targets; the evaluation loss is the token-weighted mean over all K batches (the sum of the
negative log-likelihoods over the sum of the targets: packed documents weight tokens, not
batches), and the perplexity exp(loss). It is the LM loss only: the router losses are left out.
So a run with evaluation trains exactly as one without (same losses bitwise, same checkpoints):
no training rng, no training data, no state is touched.
"""

import dataclasses
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from relaymoe_jax.xla_options import XLA_OPTIONS

from ..data import loader
from ..data.format import DatasetError
from ..data.prepared import PreparedSource
from ..data.source import Batch
from ..settings import RunSettings
from . import objective, train_step
from .offload import fetch_params

EVAL_SEED = 0  # the shuffle that picks the evaluation rows: fixed, not the training seed


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """One evaluation: the token-weighted mean next-token loss and the targets it averages."""

    loss: float
    targets: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf

    def record(self) -> dict:
        """The fields it adds to its step's metrics.jsonl line."""
        return {"eval_loss": self.loss, "eval_perplexity": self.perplexity}


def _tokenizer(source) -> str:
    t = source.manifest.tokenizer
    return t.describe() + ("" if t.sha256 is None else f" (sha256 {t.sha256[:12]})")


def open_eval_data(run: RunSettings, train_data) -> PreparedSource:
    """The prepared dataset `run.eval_data`, checked before anything is built: a prepared
    dataset directory, prepared with the training data's tokenizer (the manifests' records:
    kind and sha256), within the model's vocabulary, with at least eval_batches * batch_size
    rows of seq_len. DatasetError (a ValueError), one line, otherwise."""
    tc, path = run.train, Path(run.eval_data)
    if not path.is_dir():
        raise DatasetError(
            f"--eval-data {path}: not a directory; expected a prepared dataset "
            "(relaymoe-train prepare FILE... --out DIR)"
        )
    try:
        source = PreparedSource(
            path, seq_len=tc.seq_len, global_batch=tc.batch_size, seed=EVAL_SEED, threads=0
        )
    except DatasetError as e:
        raise DatasetError(f"--eval-data: {e}") from None
    source.check(run.model.vocab_size)
    theirs, ours = source.manifest.tokenizer, getattr(train_data, "manifest", None)
    if ours is not None and (theirs.kind, theirs.sha256) != (
        ours.tokenizer.kind,
        ours.tokenizer.sha256,
    ):
        raise DatasetError(
            f"--eval-data {path} was prepared with {_tokenizer(source)}, the training data with "
            f"{_tokenizer(train_data)}: prepare the evaluation text with the training data's "
            "tokenizer"
        )
    need = tc.eval_batches * tc.batch_size
    if source.num_rows < need:
        raise DatasetError(
            f"--eval-data {path} has {source.num_rows:,} rows of seq_len={tc.seq_len} "
            f"({source.corpus.tokens:,} tokens); eval_batches={tc.eval_batches} x "
            f"batch_size={tc.batch_size} needs {need:,}: lower eval_batches or give more text"
        )
    return source


def identity(source: PreparedSource) -> dict:
    """What the checkpoint metadata records of the evaluation data (`train.state.identity`): its
    directory and manifest sha256, as the training data's `identity()` has them."""
    return source.identity()["dataset"]


def read_rows(source: PreparedSource, rows, eval_batches: int) -> list[Batch]:
    """This process's rows `rows` of each of the first `eval_batches` global batches (global
    sample b * batch_size + r, `PackedRows.sample`), as host arrays; no segment ids for a
    corpus of one document (`PreparedSource.packed`)."""
    out = []
    for b in range(eval_batches):
        samples = [source.sample(b * source.global_batch + r) for r in rows]
        batch = Batch(*(np.stack(field) for field in zip(*samples)))
        out.append(batch if source.packed else Batch(batch.tokens))
    return out


def make_eval(graphdef, tc):
    """evaluate(params, rest, batch) -> (nll, targets): the summed next-token loss of `batch`
    and its count of targets, by the train step's own terms (`objective.make_terms`), forward
    only."""
    dtype = jnp.dtype(tc.compute_dtype)
    terms = objective.make_terms(graphdef, dtype, tc.loss_chunk)

    def evaluate(params, rest, batch: Batch):
        if tc.offload_optimizer:  # host-resident weights, fetched as the train step does
            params = fetch_params(params, dtype)
        nll, weights, _aux = terms(params, rest, batch)  # the router losses are not evaluated
        return nll, jnp.sum(weights)

    return evaluate


class Evaluator:
    """The evaluation of a run: its rows on the device and the compiled forward; `evaluator(state)`
    is the `EvalResult` of the train state `state`."""

    def __init__(self, run: RunSettings, graphdef, state, ids_sharding, source: PreparedSource):
        tc = run.train
        shape = (tc.batch_size, tc.seq_len)
        rows = loader.rows_of_process(ids_sharding, shape)
        self.batches = [
            train_step.put_batch(b, ids_sharding, tc.batch_size, rows)
            for b in read_rows(source, rows, tc.eval_batches)
        ]
        key = (train_step.step_key(run.model, tc, shape, ids_sharding.mesh, source.packed), "eval")

        def build():
            sharding = lambda t: jax.tree.map(lambda x: x.sharding, t)
            jitted = jax.jit(
                make_eval(graphdef, tc),
                in_shardings=(sharding(state.params), sharding(state.rest), ids_sharding),
                out_shardings=NamedSharding(ids_sharding.mesh, P()),
                compiler_options=XLA_OPTIONS,
            )
            return jitted.lower(state.params, state.rest, self.batches[0]).compile()

        self.compiled = train_step.memoised(key, build)

    def __call__(self, state) -> EvalResult:
        outs = jax.device_get([self.compiled(state.params, state.rest, b) for b in self.batches])
        nll, counts = (np.asarray(x, np.float64) for x in zip(*outs))
        total = float(counts.sum())
        return EvalResult(float(nll.sum() / max(total, 1.0)), int(total))

"""Context parallelism for the attention cores that run on the whole sequence (``cp_whole_sequence``): content-based
(LSH, Sinkhorn), low-rank and pooled (Nystromformer, memory-compressed, Set Transformer, Luna), synthesizers,
priors (Gaussian, adaptive span), RealFormer, talking heads and routing (its k-means statistics, the same on every cp
rank, summed over the data-parallel ranks only).

Every cp rank all-gathers Q, K and V, runs the core's single-device code on every position and keeps its rows. Module
level (2 gloo ranks), each kind as decoder and encoder where it can be, contiguous and load balanced, with dropout
and attention dropout: each rank's hidden states, the summed loss and every gradient equal one process's. Trainer
level: 10-step loss parity of a Nystromformer encoder under cp=2 x ZeRO-1, of routing attention (centroids moving
every step) under dp x cp, of talking heads under tp x cp. With ALiBi and T5 biases the rank's bias rows are
gathered with Q.
"""

from __future__ import annotations

import pytest
from parity_models import DECODER, ENCODER, assert_cores_under_cp_equal_one_process, assert_parity
from spawned import spawn

from xscale.models.registry import ATTENTION
from xscale.models.traits import traits_of

SEQ, BATCH, SEED = 32, 2, 11
SMALL = ["model.vocab_size=32", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.max_seq_len=32", "train.seq_len=32", "model.dropout=0.1", "model.attention_dropout=0.2"]
OPTIONS = {"lsh": ["buckets=4", "rounds=2", "chunk=8"], "sinkhorn": ["block_size=8"], "nystrom": ["landmarks=4"],
           "memory_compressed": ["compression=3"], "inducing": ["inducing_points=4"], "luna": ["packed_length=4"],
           "synthesizer": [], "gaussian": [], "adaptive_span": ["max_span=16", "ramp=4"], "realformer": [],
           "talking_heads": [], "routing": ["clusters=2", "window=8"], "clustered": ["clusters=4", "topk=4"],
           "probsparse": ["factor=2"], "skyformer": ["landmarks=4"], "multiscale": [], "average": [],
           "long_short": ["window=4", "rank=4", "segment=8"], "fnet": [], "gmlp": [],
           "mlp_mixer": [],
           "persistent": ["persistent_vectors=4"], "etc": ["global_tokens=2", "window=4"],
           "image_local": ["grid_width=8", "query_block=[2,4]", "memory_margin=[1,2]"], "bpt": ["window=1"],
           "predictive": []}
WHOLE = sorted({ATTENTION.get(kind) for kind in ATTENTION.names() if traits_of(ATTENTION.get(kind)).cp_whole_sequence},
               key=lambda cls: cls.__name__)


def _cases() -> list[tuple[str, str, list[str]]]:
    cases = []
    for kind, options in OPTIONS.items():
        core = ATTENTION.get(kind)
        families = [family for family, capable in (("decoder", core.causal_capable),
                                                   ("encoder", core.bidirectional_capable)) if capable]
        cases += [(kind, family, options) for family in families]
    cases += [("synthesizer", "decoder", ["mode=random"]), ("synthesizer", "decoder", ["model.position=alibi"]),
              ("gaussian", "encoder", ["model.position=t5_bias"]), ("talking_heads", "decoder", ["model.position=alibi"])]
    return cases


def test_every_whole_sequence_core_has_a_case():
    assert {ATTENTION.get(kind) for kind in OPTIONS} == set(WHOLE)


def _check_cases(rank: int) -> None:
    assert_cores_under_cp_equal_one_process(rank, _cases(), SMALL, seq=SEQ, batch_size=BATCH, seed=SEED)


def test_whole_sequence_cores_under_context_parallelism_equal_one_process():
    spawn(_check_cases)


def test_loss_parity_nystrom_encoder_cp_zero1(tmp_path):
    nystrom = ["model.attention.kind=nystrom", "model.attention.options.landmarks=4"]
    assert_parity(ENCODER + nystrom, ["cp=2,cp_load_balance=true,zero_stage=1"], tmp_path, same_grad_norms=True)




@pytest.mark.slow
def test_loss_parity_talking_heads_decoder_tensor_x_context(tmp_path):
    """Talking heads gathers every head's q and k over tp (``gather_heads``) and the whole sequence over cp."""
    talking = ["model.attention.kind=talking_heads", "model.dropout=0.1", "model.attention_dropout=0.1"]
    assert_parity(DECODER + talking, ["tp=2,cp=2,cp_load_balance=true"], tmp_path, same_grad_norms=True)


@pytest.mark.slow
def test_loss_parity_routing_decoder_data_x_context(tmp_path):
    """The centroids move every step by statistics summed over dp only: each cp rank computed the whole sequence's."""
    routing = ["model.attention.kind=routing", "model.attention.options.clusters=2", "model.attention.options.window=8",
               "model.attention.options.decay=0.5"]
    assert_parity(DECODER + routing, ["dp_shard=2,cp=2,cp_load_balance=true"], tmp_path, same_grad_norms=True)

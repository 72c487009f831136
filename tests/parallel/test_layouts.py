"""Tensor, sequence and pipeline parallel layouts through the trainer: 10-step loss parity with one process,
alone and composed with each other and with data parallel / ZeRO (the engines' own gradient checks live beside
them)."""

from __future__ import annotations

import pytest
from parity_models import DECODER, DROPOUT, ENCODER, ENCODER_DECODER, assert_parity

from xscale.config.schema import ConfigError

PIPELINE_TENSOR = ["pp=2,tp=2,microbatches=2",
                   "pp=2,tp=2,sequence_parallel=true,microbatches=2,activation_checkpointing=full"]


def test_decoder_tensor_sequence_and_pipeline_parallel(tmp_path):
    assert_parity(DECODER, ["tp=2", "tp=2,sequence_parallel=true", "pp=2,microbatches=2",
                            "pp=2,microbatches=4,pp_schedule=gpipe"], tmp_path)


def test_encoder_tensor_and_pipeline_parallel(tmp_path):
    # pp=2 with parallel.microbatches unset: the trainer resolves it (1f1b: 2 microbatches) before building the engine.
    assert_parity(ENCODER, ["tp=2", "pp=2"], tmp_path)


@pytest.mark.slow
def test_encoder_decoder_pipeline_parallel(tmp_path):
    """Stages cut at the encoder/decoder boundary (pp=2 over 2 + 2 layers), after every layer (interleaved 1F1B,
    4 stages: inside the encoder, at the boundary, inside the decoder), and the decoder's embedding copy on a
    ZeRO-1 data-parallel stage; the per-step gradient norms too (tied copies counted once)."""
    assert_parity(ENCODER_DECODER, ["pp=2", "pp=2,microbatches=4,pp_schedule=interleaved_1f1b,pp_stages_per_rank=2",
                                    "pp=2,dp_shard=2,zero_stage=1,microbatches=2"], tmp_path, same_grad_norms=True)


@pytest.mark.slow
def test_encoder_decoder_pipeline_with_dropout_embedding_norm_and_zero3(tmp_path):
    """The first decoder stage's copies (embedding and its norm) under ZeRO-3, zero bubble with recomputation, and
    dropout masks that follow the microbatch (the decoder's embedding dropout included)."""
    assert_parity(ENCODER_DECODER + DROPOUT[:2] + ["model.embedding_norm=true"], [
        "pp=2,dp_shard=2,zero_stage=3,microbatches=2",
        "pp=2,microbatches=2,pp_schedule=zero_bubble,pp_stages_per_rank=2,activation_checkpointing=full",
        "pp=2,microbatches=4,pp_schedule=gpipe"], tmp_path, same_grad_norms=True)


@pytest.mark.slow
def test_encoder_decoder_pipeline_x_tensor_parallel(tmp_path):
    """The first decoder stage's embedding copy (and its norm) split by vocabulary like the first stage's; with
    sequence parallelism the memory travels between stages as each tp rank's sequence shard."""
    assert_parity(ENCODER_DECODER + ["model.embedding_norm=true"], [
        "pp=2,tp=2,microbatches=2",
        "pp=2,tp=2,sequence_parallel=true,microbatches=4,pp_schedule=interleaved_1f1b,pp_stages_per_rank=2"],
        tmp_path, same_grad_norms=True)


def test_dropout_masks_match_one_device_under_sequence_data_and_pipeline_parallel(tmp_path):
    assert_parity(DECODER + DROPOUT, ["tp=2,sequence_parallel=true", "dp_shard=2,zero_stage=3,activation_checkpointing=full",
                                      "pp=2,microbatches=4,activation_checkpointing=full"], tmp_path)


@pytest.mark.slow
def test_dropout_masks_match_one_device_under_tensor_and_composed_parallel(tmp_path):
    assert_parity(DECODER + DROPOUT, ["tp=2", "dp_shard=2,tp=2,sequence_parallel=true",
                                      "pp=2,tp=2,microbatches=4,sequence_parallel=true"], tmp_path)
    assert_parity(ENCODER + DROPOUT, ["tp=2,sequence_parallel=true"], tmp_path)


@pytest.mark.slow
def test_dropout_masks_match_one_device_under_every_pipeline_schedule(tmp_path):
    """Each stage's k-th forward is microbatch k's, whatever the schedule's order; recomputation (activation
    checkpointing) in a later backward draws the masks of the forward it repeats."""
    assert_parity(DECODER + DROPOUT + ["model.n_layers=4"], [
        "pp=2,microbatches=4,activation_checkpointing=full", "pp=2,microbatches=4,pp_schedule=gpipe",
        "pp=2,microbatches=4,pp_schedule=interleaved_1f1b,pp_stages_per_rank=2",
        "pp=2,microbatches=4,pp_schedule=zero_bubble,pp_stages_per_rank=2,activation_checkpointing=full"], tmp_path)


def test_block_sparse_attention_dropout_matches_one_device_under_tensor_parallel(tmp_path):
    """Block-sparse cores mask their gathered blocks by global (sample, head, query, key): tp=2 ranks hold half
    the heads (and in microbatches of 2, a slice of the samples)."""
    bigbird = ["model.attention.kind=bigbird",
               "model.attention.options={window: 4, global_tokens: 2, random_blocks: 1, block_size: 4}"]
    assert_parity(DECODER + DROPOUT + bigbird, ["tp=2"], tmp_path)


@pytest.mark.slow
def test_talking_heads_dropout_matches_one_device_under_tensor_parallel(tmp_path):
    """Each tp rank drops its own output heads' mixed weights W' (B, H/tp, T, T) by global head, after mixing
    every head's (gathered) logits."""
    talking_heads = ["model.attention.kind=talking_heads", "model.position=alibi"]
    assert_parity(DECODER + DROPOUT + talking_heads, ["tp=2,sequence_parallel=true"], tmp_path)


@pytest.mark.slow
def test_head_shared_and_score_carrying_attention_dropout_under_tensor_parallel(tmp_path):
    """memory_compressed (probabilities over slots and own block), sinkhorn (own and sorted blocks) and realformer
    drop their probabilities by global head under tp=2."""
    for kind, options in (("memory_compressed", "{compression: 3}"), ("sinkhorn", "{block_size: 4}"),
                          ("realformer", "{}")):
        overrides = [f"model.attention.kind={kind}", f"model.attention.options={options}"]
        assert_parity(DECODER + DROPOUT + overrides, ["tp=2"], tmp_path / kind)


@pytest.mark.slow
def test_low_rank_and_sparse_attention_dropout_match_one_device_under_data_and_sequence_parallel(tmp_path):
    """Linformer drops its explicit probabilities (B, H, T, k) by global position; longformer under tp + sp."""
    linformer = ["model.attention.kind=linformer", "model.attention.options={projected_length: 8}"]
    assert_parity(ENCODER + DROPOUT + linformer, ["dp_shard=2", "tp=2"], tmp_path / "linformer")
    longformer = ["model.attention.kind=longformer", "model.attention.options={window: 3, global_tokens: 1, block_size: 4}"]
    assert_parity(DECODER + DROPOUT + longformer, ["tp=2,sequence_parallel=true"], tmp_path / "longformer")


def test_parity_refuses_layout_dependent_attention_dropout(tmp_path, monkeypatch):
    """A core drawing attention dropout from torch's RNG (none is registered now) is refused before any run."""
    from xscale.models.attention.lowrank import LinformerAttention

    monkeypatch.setattr(LinformerAttention, "rng_dropout", True)
    with pytest.raises(ConfigError, match="linformer draws attention dropout"):
        assert_parity(ENCODER + ["model.attention_dropout=0.1", "model.attention.kind=linformer"], ["tp=2"], tmp_path)


@pytest.mark.slow
def test_composed_layouts_at_four_ranks(tmp_path):
    assert_parity(DECODER, ["dp_shard=2,tp=2", "dp_shard=2,tp=2,zero_stage=3", "dp_replicate=2,dp_shard=1,tp=2",
                            "pp=2,dp_shard=2,microbatches=2,zero_stage=1", "pp=2,dp_shard=2,microbatches=2,zero_stage=2",
                            "pp=2,dp_shard=2,microbatches=2"], tmp_path)


@pytest.mark.slow
def test_every_pipeline_schedule(tmp_path):
    assert_parity(DECODER + ["model.n_layers=4"], ["pp=2,microbatches=2,pp_schedule=1f1b",
                                                   "pp=2,microbatches=4,pp_schedule=interleaved_1f1b,pp_stages_per_rank=2",
                                                   "pp=2,microbatches=2,pp_schedule=zero_bubble,pp_stages_per_rank=2"],
                  tmp_path)


@pytest.mark.slow
def test_pipeline_with_zero3_at_four_ranks(tmp_path):
    """FSDP2 stages: the tied embedding's two ends are FSDP2 shards, summed over the pipeline; zero-bubble's
    split backward needs the stage gathered from forward to backward (also under activation checkpointing)."""
    assert_parity(DECODER, ["pp=2,dp_shard=2,microbatches=2,zero_stage=3"], tmp_path / "decoder")
    assert_parity(ENCODER, ["pp=2,dp_shard=2,microbatches=2,zero_stage=3"], tmp_path / "encoder")
    assert_parity(DECODER + ["model.n_layers=4"],
                  ["pp=2,dp_shard=2,microbatches=4,zero_stage=3,pp_schedule=interleaved_1f1b,pp_stages_per_rank=2,"
                   "activation_checkpointing=full",
                   "pp=2,dp_shard=2,microbatches=2,zero_stage=3,pp_schedule=zero_bubble,pp_stages_per_rank=2,"
                   "activation_checkpointing=selective"],
                  tmp_path / "schedules")


@pytest.mark.slow
def test_routing_attention_centroids_move_alike_under_data_parallel(tmp_path):
    routing = ["model.attention.kind=routing", "model.attention.options={clusters: 2, window: 8}"]
    assert_parity(DECODER + routing, ["dp_shard=2"], tmp_path)


ROUTING = ["model.attention.kind=routing", "model.attention.options={clusters: 2, window: 4, decay: 0.5}",
           "model.n_layers=4"]


@pytest.mark.slow
def test_routing_attention_under_pipeline_parallel(tmp_path):
    """Each stage routes microbatch k with the centroids moved by microbatches 0..k-1, as one process running the
    same microbatches (of 2 rows) does; under recomputation the backward routes as its forward did."""
    assert_parity(DECODER + ROUTING + ["train.micro_batch_size=2"],
                  ["pp=2,microbatches=4", "pp=2,microbatches=4,activation_checkpointing=full"],
                  tmp_path, same_grad_norms=True)


@pytest.mark.slow
def test_routing_attention_under_pipeline_x_tensor_parallel(tmp_path):
    """pp x tp with recomputation: each stage's cores hold their heads' centroids (split by head over tp), and a
    backward's recomputation routes with the centroids its forward used."""
    assert_parity(DECODER + ROUTING + ["train.micro_batch_size=2"],
                  ["pp=2,tp=2,microbatches=4,activation_checkpointing=full"], tmp_path, same_grad_norms=True)


@pytest.mark.slow
def test_routing_attention_under_pipeline_and_data_parallel(tmp_path):
    """Each stage's cores sum their statistics over the stage's data-parallel replicas: one microbatch per dp rank
    (gpipe), so a step's statistics are the whole batch's, as on one process."""
    assert_parity(DECODER + ROUTING, ["pp=2,dp_shard=2,microbatches=1,pp_schedule=gpipe",
                                      "pp=2,dp_shard=2,zero_stage=3,microbatches=1,pp_schedule=gpipe,"
                                      "activation_checkpointing=selective"], tmp_path, same_grad_norms=True)


@pytest.mark.slow
def test_decoder_pipeline_x_tensor_parallel(tmp_path):
    assert_parity(DECODER, PIPELINE_TENSOR, tmp_path, same_grad_norms=True)


@pytest.mark.slow
def test_encoder_pipeline_x_tensor_parallel(tmp_path):
    assert_parity(ENCODER, PIPELINE_TENSOR, tmp_path, same_grad_norms=True)


@pytest.mark.slow
def test_pipeline_schedules_under_tensor_parallel(tmp_path):
    """Several stages per rank: interleaved (loop placement) and ZB-V (both tied ends on rank 0, backward split
    into input and weight halves) over tp-split stages."""
    assert_parity(DECODER + ["model.n_layers=4"],
                  ["pp=2,tp=2,microbatches=4,pp_schedule=interleaved_1f1b,pp_stages_per_rank=2",
                   "pp=2,tp=2,sequence_parallel=true,microbatches=2,pp_schedule=zero_bubble,pp_stages_per_rank=2"],
                  tmp_path, same_grad_norms=True)


@pytest.mark.slow
def test_three_dimensional_layout(tmp_path):
    """pp=2 x dp_shard=2 x tp=2 on 8 ranks, with ZeRO-1, and ZeRO-2 + sequence parallelism."""
    assert_parity(DECODER, ["pp=2,dp_shard=2,tp=2,microbatches=2,zero_stage=1",
                            "pp=2,dp_shard=2,tp=2,sequence_parallel=true,microbatches=2,zero_stage=2"],
                  tmp_path, same_grad_norms=True)


@pytest.mark.slow
def test_t5_bias_table_under_pipeline_data_and_tensor_parallel(tmp_path):
    """T5's relative bias table is read by every layer: each stage holds a copy, the copies' gradients are summed
    over the pp ranks (sharded alike under ZeRO-3, replicated under tp) and the norm counts the table once."""
    t5 = DECODER + ["model.position=t5_bias", "model.n_layers=4"]
    assert_parity(t5, ["pp=2", "pp=2,dp_shard=2,zero_stage=3", "pp=2,tp=2",
                       "pp=2,tp=2,pp_schedule=zero_bubble,pp_stages_per_rank=2,microbatches=2,"
                       "activation_checkpointing=full"],
                  tmp_path, same_grad_norms=True)


@pytest.mark.slow
def test_t5_encoder_decoder_under_pipeline_and_zero3(tmp_path):
    """T5 (encoder-decoder, relative bias tables, tied embeddings) over 2 + 3 layers: stage 0 runs the encoder and
    the first decoder block, so both stages hold a copy of the decoder's table (and of the embedding); its gradients
    are summed over the pp ranks (sharded alike under ZeRO-3), and the norm counts each parameter once. Zero bubble
    (4 stages over [2, 1, 1, 1]: the decoder starts on stage 1) splits stages 2 and 3's backward around the table."""
    t5 = ENCODER_DECODER + ["model.position=t5_bias", "model.tie_embeddings=true", "model.n_decoder_layers=3"]
    assert_parity(t5, ["pp=2", "pp=2,dp_shard=2,zero_stage=3",
                       "pp=2,pp_schedule=zero_bubble,pp_stages_per_rank=2,microbatches=2"],
                  tmp_path, same_grad_norms=True)


@pytest.mark.slow
def test_realformer_encoder_decoder_under_pipeline_parallel(tmp_path):
    """Each stack's scores cross the stage boundaries inside it: over 3 + 3 layers cut [2, 2, 1, 1], the encoder's
    leave stage 0 with its hidden states, the decoder's leave stages 1 and 2 after the memory; with dropout, under
    ZeRO-3 and zero bubble with recomputation."""
    realformer = ENCODER_DECODER + ["model.position=alibi", "model.attention.kind=realformer", "model.n_layers=3",
                                    "model.n_decoder_layers=3"]
    assert_parity(realformer + DROPOUT[:2], [
        "pp=2,pp_schedule=interleaved_1f1b,pp_stages_per_rank=2,microbatches=4",
        "pp=2,dp_shard=2,zero_stage=3,pp_schedule=interleaved_1f1b,pp_stages_per_rank=2,microbatches=2",
        "pp=2,pp_schedule=zero_bubble,pp_stages_per_rank=2,microbatches=2,activation_checkpointing=full"],
        tmp_path, same_grad_norms=True)


@pytest.mark.slow
def test_realformer_scores_cross_pipeline_stages(tmp_path):
    """RealFormer's scores travel with the hidden states from stage to stage, and their gradients back."""
    realformer = DECODER + ["model.position=alibi", "model.attention.kind=realformer", "model.n_layers=4"]
    assert_parity(realformer, ["pp=2", "pp=2,dp_shard=2,zero_stage=3,microbatches=2",
                               "pp=2,pp_schedule=zero_bubble,pp_stages_per_rank=2,microbatches=2,"
                               "activation_checkpointing=full"], tmp_path, same_grad_norms=True)


@pytest.mark.slow
def test_realformer_scores_cross_pipeline_stages_under_tensor_parallel(tmp_path):
    """Under pp x tp each tp rank's stage sends the scores of its own heads (B, H/tp, T, T) to the same tp rank of
    the next stage; ALiBi's bias is sliced by head on both stages."""
    realformer = DECODER + ["model.position=alibi", "model.attention.kind=realformer", "model.n_layers=4"]
    assert_parity(realformer, ["pp=2,tp=2,microbatches=2",
                               "pp=2,tp=2,sequence_parallel=true,microbatches=4,pp_schedule=interleaved_1f1b,"
                               "pp_stages_per_rank=2,activation_checkpointing=full"], tmp_path, same_grad_norms=True)


@pytest.mark.slow
def test_talking_heads_and_realformer_under_pipeline_x_tensor_parallel(tmp_path):
    """Talking heads (q and k gathered over tp) between RealFormer blocks: layer 0's scores pass by layer 1 and cross
    the stage boundary to layers 2 and 3."""
    mixed = DECODER + ["model.position=alibi", "model.n_layers=4",
                       "model.attention.per_layer=[realformer, talking_heads, realformer, realformer]"]
    assert_parity(mixed, ["pp=2,tp=2,microbatches=2"], tmp_path, same_grad_norms=True)


HEAD_SPLIT_ROUTING = ["model.attention.kind=routing", "model.attention.options={clusters: 2, window: 8, decay: 0.5}"]
SYNTHESIZER = ["model.attention.kind=synthesizer", "model.attention.options={mode: dense}", "model.max_seq_len=16"]


@pytest.mark.slow
def test_per_head_state_split_by_tensor_parallel(tmp_path):
    """Routing's centroids (moved by every training forward) and the Synthesizer's weights, split by head over
    tp=2: each rank holds and updates its heads' rows; the Synthesizer's attention dropout by global head too."""
    assert_parity(DECODER + HEAD_SPLIT_ROUTING, ["tp=2,sequence_parallel=true"], tmp_path / "routing", same_grad_norms=True)
    assert_parity(DECODER + SYNTHESIZER, ["tp=2"], tmp_path / "synthesizer", same_grad_norms=True)
    assert_parity(DECODER + DROPOUT + SYNTHESIZER, ["tp=2,sequence_parallel=true"], tmp_path / "dropout")


@pytest.mark.slow
def test_per_head_state_under_data_tensor_parallel_and_zero3(tmp_path):
    """dp_shard=2 x tp=2 with ZeRO-3: routing's statistics are summed over dp only (each tp rank holds other
    heads), with activation checkpointing replaying the forwards; the Synthesizer's per-head weights FSDP-sharded."""
    assert_parity(DECODER + HEAD_SPLIT_ROUTING, ["dp_shard=2,tp=2,zero_stage=3,activation_checkpointing=full",
                                      "dp_shard=2,tp=2"], tmp_path / "routing", same_grad_norms=True)
    assert_parity(DECODER + SYNTHESIZER, ["dp_shard=2,tp=2,zero_stage=3"], tmp_path / "synthesizer",
                  same_grad_norms=True)


@pytest.mark.slow
def test_per_head_state_under_pipeline_x_tensor_parallel(tmp_path):
    """Each stage splits its cores' per-head state by head (the Synthesizer's weights, the Gaussian widths)."""
    mixed = ["model.attention.kind=synthesizer", "model.attention.per_layer=[synthesizer,gaussian]",
             "model.attention.options={mode: dense, sigma: 3.0}", "model.max_seq_len=16"]
    assert_parity(DECODER + mixed, ["pp=2,tp=2,microbatches=2"], tmp_path, same_grad_norms=True)


SHARED_LAYERS = DECODER + ["model.share_layers=true", "model.n_layers=4"]


@pytest.mark.slow
def test_shared_layers_under_pipeline_parallel_with_dropout(tmp_path):
    """ALBERT-style sharing (one block at every depth): each stage holds the block and runs it at its depths, with
    the single-process dropout sites; the copies' gradients are summed over the pp ranks and counted once."""
    assert_parity(SHARED_LAYERS + DROPOUT, ["pp=2,microbatches=4,activation_checkpointing=full",
                                            "pp=2,microbatches=4,pp_schedule=interleaved_1f1b,pp_stages_per_rank=2"],
                  tmp_path, same_grad_norms=True)


@pytest.mark.slow
def test_shared_layers_under_pipeline_zero3_and_tensor_parallel(tmp_path):
    """The shared block's copies as FSDP2 shards (summed shard by shard over the pipeline) and tp-split; zero
    bubble runs a stage reusing the block whole in its input half."""
    assert_parity(SHARED_LAYERS, ["pp=2,dp_shard=2,zero_stage=3,microbatches=2", "pp=2,tp=2,microbatches=2",
                                  "pp=2,pp_schedule=zero_bubble,pp_stages_per_rank=2,microbatches=2,"
                                  "activation_checkpointing=full"], tmp_path, same_grad_norms=True)

"""The layout calculator on mixtures of experts, grouped-query attention and FSDP-style
sharding: parameters counted total and active (on the package's own model where it can build
one, against the papers' totals where it cannot), the all-to-all priced inside and across
machines, and two published layouts, DeepSeek-V3's and Llama 3 405B's at 128K tokens, each
fitting where its paper ran it, with the dimensions memory sets shown by the layouts beside
it that do not fit."""
import dataclasses

import pytest
from hypothesis import given, strategies as st

import d2lperf as d2l
from d2lperf.comm import cost
from d2lperf.model_parallel import predict, published

from strategies import checks

pytestmark = pytest.mark.chapter('parallel_layouts')

LLAMA, DEEPSEEK = published.LLAMA3_405B, published.DEEPSEEK_V3
LONG_CONTEXT, DEEPSEEK_LAYOUT = published.LLAMA3_LONG_CONTEXT, published.DEEPSEEK_V3_LAYOUT
GB = 1e9


def real_values(params):
    return sum(p.data().size for p in params)


def gpt_with_mixtures(sizes, num_experts, top_k, moe_every):
    """The package's GPT with every `moe_every`-th layer's MLP a mixture, initialized, so that
    its values are real; and its mixtures."""
    net = d2l.nn.GPT(*dataclasses.astuple(sizes), num_experts=num_experts, top_k=top_k,
                     moe_every=moe_every)
    net.initialize()
    return net, net.mixtures()


# -- parameters, total and active ---------------------------------------------------------------

@pytest.mark.parametrize('num_experts, top_k, moe_every', [(4, 1, 2), (4, 2, 2), (8, 2, 1),
                                                           (2, 2, 3)])
def test_a_gpt_with_experts_is_counted_as_the_model_holds_it(num_experts, top_k, moe_every):
    """Total: every value of the model. Active: those a token uses, all but the experts it
    does not go to (E - k of each mixture's, counted on the mixture's own experts)."""
    sizes = predict.GPTSizes(vocab=50, layers=4, hidden=16, heads=4, seq=8)
    net, mixtures = gpt_with_mixtures(sizes, num_experts, top_k, moe_every)
    total = real_values(net.collect_params().values())
    unused = sum(real_values(expert.collect_params().values())
                 for moe in mixtures for expert in moe.experts[top_k:])
    assert published.gpt_with_experts(sizes, num_experts, top_k, moe_every) == (
        total, total - unused)


def test_the_count_follows_the_mixture(monkeypatch):
    """Experts twice as wide as GPT-2's MLP: the count changes with the block, since nothing
    in the calculator spells out an expert's parameters."""
    from d2lperf.nn import transformer
    defaults = transformer.MLP.__init__.__defaults__
    monkeypatch.setattr(transformer.MLP.__init__, '__defaults__', (8,) + defaults[1:])
    sizes = predict.GPTSizes(vocab=50, layers=2, hidden=16, heads=4, seq=8)
    net, _ = gpt_with_mixtures(sizes, 4, 2, 1)
    assert published.gpt_with_experts(sizes, 4, 2, 1)[0] == real_values(
        net.collect_params().values())


@checks(30)
@given(count=st.integers(1, 64), data=st.data(), every=st.integers(1, 4),
       dense_first=st.integers(0, 5), shared=st.integers(0, 2))
def test_a_token_uses_the_dense_part_and_k_experts_a_mixture(count, data, every, dense_first,
                                                             shared):
    """Whatever the mixture: the experts a token skips, E - k a mixture layer, are what
    total and active differ by, and a mixture of one expert is a dense model's count."""
    top_k = data.draw(st.integers(1, count))
    experts = published.Experts(count, top_k, width=32, every=every, dense_first=dense_first,
                                shared=shared)
    sizes = published.ModelSizes(vocab=100, layers=12, hidden=16, heads=4, seq=8, ffn=64,
                                 experts=experts)
    moe = (12 - dense_first) // every
    assert sizes.mixture_layers() == moe
    assert sizes.params() - sizes.params(active=True) == moe * (count - top_k) * 3 * 16 * 32
    assert sizes.routed_values() == moe * count * 3 * 16 * 32


def test_llama3_405b_has_405_billion_parameters():
    """Table 3's sizes give 405.85B, the paper's "405B"; a dense model uses all of them."""
    assert LLAMA.params() == 405_853_388_800
    assert LLAMA.params(active=True) == LLAMA.params()


def test_deepseek_v3_has_671b_parameters_and_37b_active():
    """§4.2: "671B total parameters, of which 37B are activated for each token" (the 14B of
    the multi-token-prediction module aside). The routed experts are 97 % of the model."""
    assert DEEPSEEK.params() / GB == pytest.approx(671, abs=0.05)
    assert DEEPSEEK.params(active=True) / GB == pytest.approx(37.55, abs=0.01)
    routed = 58 * 256 * 3 * 7168 * 2048
    assert DEEPSEEK.routed_values() == routed
    assert DEEPSEEK.params() - DEEPSEEK.params(active=True) == 58 * 248 * 3 * 7168 * 2048
    assert routed / DEEPSEEK.params() == pytest.approx(0.974, abs=0.001)


def test_multi_head_latent_attention_is_counted_by_its_projections():
    """DeepSeek-V3 §2.1.1: down to the query latent (1,536) and the key/value latent (512)
    with the shared RoPE key (64), back up to 128 heads, and the output projection."""
    h, heads = 7168, 128
    expected = (h * 1536 + 1536 + 1536 * heads * 192 + h * (512 + 64) + 512
                + 512 * heads * 256 + heads * 128 * h)
    assert DEEPSEEK.attention_values() == expected == 187_107_328


# -- grouped-query attention --------------------------------------------------------------------

def test_grouped_query_attention_shrinks_the_key_and_value_projections():
    """Llama 3's 8 key/value heads for 128 query heads: the key and value projections are
    1/16 as wide, the query and output projections whole."""
    h, kv = LLAMA.hidden, 8 * 128
    assert LLAMA.attention_values() == h * (h + 2 * kv) + h * h
    multi_head = dataclasses.replace(LLAMA, kv_heads=None)
    assert multi_head.attention_values() == 4 * h * h
    assert multi_head.params() - LLAMA.params() == 126 * 2 * h * (h - kv)


def test_grouped_query_attention_keeps_smaller_keys_and_values():
    """A token's keys and values kept for backward shrink by the same 1/16: 2 bytes each of
    2·(16,384 - 1,024) features fewer."""
    multi_head = dataclasses.replace(LLAMA, kv_heads=None)
    saved = (published.token_activations(multi_head, False)
             - published.token_activations(LLAMA, False))
    assert saved == 2 * 2 * (16384 - 1024)


# -- FSDP-style sharding ------------------------------------------------------------------------

@pytest.mark.parametrize('d', [1, 8, 64])
def test_fsdp_shards_every_state_and_keeps_the_stage_gathered(d):
    """Megatron-LM's 18 bytes a parameter divided by d (ZeRO-3's table), plus the stage's
    16-bit weights gathered and kept through the step, as Llama 3 does not reshard after the
    forward pass (§3.3.2): 2 + 18/d bytes a parameter, beside ZeRO-1's 6 + 12/d."""
    layout = dataclasses.replace(LONG_CONTEXT, data=d)
    values = LLAMA.params() / (8 * 16)
    fsdp = published.stage_states(LLAMA, layout, predict.MEGATRON)
    zero1 = published.stage_states(LLAMA, dataclasses.replace(layout, fsdp=False, zero_stage=1),
                                   predict.MEGATRON)
    assert fsdp == pytest.approx((2 + 18 / d) * values)
    assert zero1 == pytest.approx((6 + 12 / d) * values)


def test_the_layout_search_prices_fsdp_as_zero1_and_holds_less():
    """GPT-3 on 64 × 8 devices: FSDP holds 2 + 18/d bytes a parameter against ZeRO-1's
    6 + 12/d, and sends what ZeRO-1 sends (a reduce-scatter of the gradients, an all-gather
    of the weights, once a step), so more layouts fit."""
    cluster = predict.Cluster(64, 8, 80e9, 150e12, 300e9, 25e9)
    d, t, p = 16, 8, 4
    zero1 = predict.layout_costs(predict.GPT3, cluster, d, t, p, 1536, zero_stage=1)
    fsdp = predict.layout_costs(predict.GPT3, cluster, d, t, p, 1536, fsdp=True)
    values = predict.GPT3.params() / (t * p)
    assert fsdp['states'] == pytest.approx((2 + 18 / d) * values)
    assert fsdp['data'] == zero1['data']
    fits = [sum(row['fits'] for _, row in predict.layouts(predict.GPT3, cluster, 1536, **kw))
            for kw in ({'zero_stage': 1}, {'fsdp': True})]
    assert fits[1] > fits[0]


# -- the all-to-all inside and across machines --------------------------------------------------

@checks(30)
@given(n=st.integers(2, 16), extra=st.integers(0, 8), chunk=st.integers(0, 10 ** 8))
def test_inside_a_machine_the_all_to_all_is_the_pairwise_exchange_on_nvlink(n, extra, chunk):
    """While the group fits in a machine, the network is never used: the exchange is
    `all_to_all_time`'s on a switch whose ports run at NVLink's speed (for arrays that cut
    into n equal chunks; the schedule cuts whole bytes)."""
    size = n * chunk
    switch = cost.Topology('NVSwitch', n, 160e9, 160e9, None, 5e-6)
    assert cost.all_to_all_across_time(size, n, n + extra, 160e9, 50e9, 5e-6) == \
        pytest.approx(cost.all_to_all_time(size, switch))


def test_across_machines_the_network_sets_the_pace():
    """64 devices on 8 machines: 56 of the 63 chunks go over the network at 50 GB/s, the 7
    others over NVLink at the same time."""
    size, alpha = 1e8, 5e-6
    assert cost.all_to_all_across_time(size, 64, 8, 160e9, 50e9, alpha) == pytest.approx(
        56 * (alpha + size / 64 / 50e9))


def test_deepseeks_all_to_alls_cost_what_their_bytes_say():
    """Dispatch and combine, forward and backward, for each of a stage's 58/16 mixtures and
    each micro-batch: 8 copies of 4,096 tokens of 7,168 16-bit features a device. Over 8
    nodes or inside one, 7/8 of a device's bytes leave it; across nodes they go at InfiniBand's
    50 GB/s, 1/3.2 of NVLink's (§3.2.2), which, with 56 messages for 7, costs 3.26 times as
    much."""
    microbatches, size, alpha = 120, 2 * 8 * 4096 * 7168, 5e-6   # 15,360 sequences / 128
    seconds = published.all_to_all_seconds(DEEPSEEK, published.H800_CLUSTER, DEEPSEEK_LAYOUT,
                                           microbatches)
    across = 56 * (alpha + size / 64 / 50e9)
    assert seconds == pytest.approx(4 * across * microbatches * 58 / 16)
    inside = dataclasses.replace(DEEPSEEK_LAYOUT, expert=8)
    within = published.all_to_all_seconds(DEEPSEEK, published.H800_CLUSTER, inside, microbatches)
    assert within == pytest.approx(4 * 7 * (alpha + size / 8 / 160e9) * microbatches * 58 / 16)
    assert seconds / within == pytest.approx(3.26, abs=0.01)


# -- DeepSeek-V3: 16-way pipeline, 64-way experts, ZeRO-1 ---------------------------------------

def deepseek_tokens(**change):
    layout = dataclasses.replace(DEEPSEEK_LAYOUT, **change)
    return published.tokens_that_fit(DEEPSEEK, layout, states=published.DEEPSEEK_STATES)


def test_deepseek_v3_fits_its_layout():
    """The paper gives no micro-batch size. Counted without its recomputation (§3.2.3) or its
    FP8 activations (§3.3.3), which hold less, the states take 25.7 GB and leave room for
    micro-batches of 1,864 tokens at DualPipe's peak; one of 1,024 fits in 55.5 GB."""
    states = published.stage_states(DEEPSEEK, DEEPSEEK_LAYOUT, published.DEEPSEEK_STATES)
    assert states / GB == pytest.approx(25.74, abs=0.01)
    assert deepseek_tokens() == pytest.approx(1864.8, abs=0.1)
    held = published.layout_memory(DEEPSEEK, dataclasses.replace(DEEPSEEK_LAYOUT, tokens=1024),
                                   states=published.DEEPSEEK_STATES)
    assert held['fits'] and held['held'] / GB == pytest.approx(55.54, abs=0.01)


def test_deepseek_v3_needs_experts_spread_over_nodes():
    """Memory sets expert parallelism's floor: the 654B routed parameters over 16 stages and
    one node's 8 GPUs leave room for 21 tokens (79.4 GB of states), and without expert
    parallelism the states alone are 508 GB a device."""
    assert deepseek_tokens(expert=8) < 32
    assert published.stage_states(DEEPSEEK, dataclasses.replace(DEEPSEEK_LAYOUT, expert=1),
                                  published.DEEPSEEK_STATES) / GB == pytest.approx(508.5, abs=0.1)


def test_halving_deepseeks_pipeline_halves_the_micro_batch_that_fits():
    """With 8 stages, each device holds twice the layers: 46 GB of states, and DualPipe's
    9 micro-batches of 2× the layers leave room for half the tokens, too few for 1,024."""
    assert deepseek_tokens(pipeline=8, data=256, in_flight=9) == pytest.approx(936.3, abs=0.1)


def test_what_memory_does_not_set_in_deepseeks_layout():
    """64-way expert parallelism is not memory's choice alone: 32-way fits 1,601 tokens. It
    spans the 8 nodes that node-limited routing (each token to at most 4 nodes, §2.1.2) and
    the all-to-all kernels (§3.2.2) are built for. DualPipe costs memory (2 copies of the
    parameters and PP + 1 micro-batches, against 1F1B's 1 and PP, Table 2): it is chosen to
    overlap the all-to-all with computation (§3.2.1). And tensor parallelism is left out
    because the memory savings of §3.2.3 make it unneeded, not because it would not help."""
    assert deepseek_tokens(expert=32) > 1024
    one_f_one_b = deepseek_tokens(copies=1, in_flight=16)
    assert one_f_one_b == pytest.approx(2451.4, abs=0.1) and one_f_one_b > deepseek_tokens()


# -- Llama 3 405B at 128K tokens: TP 8, CP 16, PP 16, FSDP --------------------------------------

def llama(**change):
    return published.layout_memory(LLAMA, dataclasses.replace(LONG_CONTEXT, **change))


def test_llama3_405b_fits_its_long_context_layout():
    """73.1 GB of 80: 13.5 GB of FSDP's states, 59.7 GB of activations (1F1B's 16
    micro-batches of the first stage's 7 layers, 8,192 tokens a device split 8 ways)."""
    held = llama()
    assert held['fits']
    assert held['states'] / GB == pytest.approx(13.48, abs=0.01)
    assert held['activations'] / GB == pytest.approx(59.66, abs=0.01)


def test_context_parallelism_brings_each_rank_back_to_8k_tokens():
    """CP 16 gives each rank 131,072 / 16 = 8,192 tokens, the length Llama 3 pre-trained at
    without activation checkpointing (§3.3.2): the same activations as that run (Table 4's
    TP 8, CP 1, PP 16 at 8K). With CP 8 a rank keeps twice as many and nothing fits."""
    assert published.device_tokens(LLAMA, LONG_CONTEXT) * 8 == 8192
    short = published.layout_memory(dataclasses.replace(LLAMA, seq=8192),
                                    dataclasses.replace(LONG_CONTEXT, context=1, data=128))
    assert short['activations'] == pytest.approx(llama()['activations'])
    assert not llama(context=8, data=16)['fits']
    assert llama(context=8, data=16)['activations'] == pytest.approx(2 * llama()['activations'])


def test_the_other_memory_driven_dimensions_of_llama3():
    """Halve the pipeline (83.7 GB: twice the layers' states a device), the tensor group
    (twice the activations), or shard only the optimizer (ZeRO-1, 83.4 GB): none fits."""
    assert llama(pipeline=8, data=16)['held'] / GB == pytest.approx(83.7, abs=0.05)
    assert not llama(tensor=4, data=16)['fits']
    zero1 = llama(fsdp=False, zero_stage=1)
    assert zero1['held'] / GB == pytest.approx(83.4, abs=0.05) and not zero1['fits']
    assert not llama(fsdp=False)['fits']


def test_llamas_all_gather_is_not_memory_driven():
    """Llama 3 gathers keys and values rather than passing them round a ring (§3.3.2) for
    its document masks and because, with 8 key/value heads, the whole sequence's keys and
    values are small: 67 MB a layer on each of the 8 tensor ranks, 0.1 % of the memory."""
    gathered = 2 * LLAMA.kv_width * LLAMA.seq / 8
    assert gathered / GB == pytest.approx(0.067, abs=0.001)
    assert gathered < 0.001 * 80e9


# -- bad input ----------------------------------------------------------------------------------

def test_bad_mixtures_and_layouts_are_named():
    with pytest.raises(ValueError, match='top_k=9 must be between 1 and the 8 experts'):
        published.Experts(count=8, top_k=9, width=16)
    with pytest.raises(ValueError, match='48 expert ranks are carved out of the data'):
        dataclasses.replace(DEEPSEEK_LAYOUT, expert=48)
    with pytest.raises(ValueError, match='fsdp=True shards every state already'):
        dataclasses.replace(LONG_CONTEXT, zero_stage=1)


def test_the_dense_calculator_refuses_a_gpt_with_experts():
    """GPTSizes counts a dense GPT: given one with mixtures, it names the count that fits."""
    net = d2l.nn.GPT(50, 2, 16, 4, 8, num_experts=2)
    assert predict.GPTSizes.of(d2l.nn.GPT(50, 2, 16, 4, 8)).params() > 0
    with pytest.raises(ValueError, match='gpt_with_experts'):
        predict.GPTSizes.of(net)

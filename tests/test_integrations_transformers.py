"""transformers: ``fuse_lm_head(model)`` gives the loss and every parameter gradient of the
model's own ``model(labels=...)``, without the logits, for every decoder family it claims
(tied and untied heads, Cohere's and Granite's logit factors folded into a temperature),
called every way transformers calls it (num_items_in_batch as int or tensor, shift_labels,
tuples, skip_logits, the Trainer with gradient accumulation); refuses what it cannot fuse;
is idempotent and reversible; and never allocates a ``[tokens, V_local]`` tensor. A deep copy
of a fused model runs on its own weights. The class-level switch (``apply_fused_lm_head``):
tests/test_integrations_transformers_switch.py.

On 2 gloo ranks, a tiny Llama (V=1001: uneven 501/500 shards) sharded over the vocabulary
gives the single process's loss and gradients with the head split every way a user gets
there: transformers' ``tp_plan`` (``"colwise"`` and the default ``"colwise_gather_output"``),
torch's ``ColwiseParallel`` (a DTensor weight), and by hand (``copy_to_tp_region`` in front,
without which the backbone gradients are silently wrong -- shown too), and under the
switch. The ranks use the eager backend: the adapters are under test here, not the kernels.
Any loss the adapters hand to transformers is scaled in place first, as the Trainer does.
The Trainer itself at TP > 1, launched with torchrun: tests/test_integrations_trainer.py.
"""

import copy
import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import vtp_runtime as vtp
from tests.helpers import TINY_FAMILIES, assert_fused_like, small_batch, tiny_causal_lm, tiny_llama_config, train_step
from vtp_runtime.testing.distributed import RankPool

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (pip install -e '.[integrations]')",
)

V, WORLD = 1001, 2
SPLIT = 345  # the hand-split head's boundary: not torch.chunk's


def _calls(ids, labels):
    """Each way transformers calls a causal LM with labels: (name, model kwargs)."""
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    return [
        ("labels", {"labels": labels}),
        ("num_items int", {"labels": labels, "num_items_in_batch": 9}),
        ("num_items tensor", {"labels": labels, "num_items_in_batch": torch.tensor(9)}),
        ("shift_labels", {"labels": labels, "shift_labels": shifted}),
        ("tuple", {"labels": labels, "return_dict": False}),
    ]


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_fused_head_gives_the_models_own_loss_and_gradients(family):
    from vtp_runtime.integrations.transformers import fuse_lm_head

    reference = tiny_causal_lm(family)
    fused = fuse_lm_head(copy.deepcopy(reference))
    ids, labels = small_batch()
    with vtp.use_backend("eager"):
        for how, kw in _calls(ids, labels):
            want, want_loss, want_grads = train_step(reference, input_ids=ids, **kw)
            got, got_loss, got_grads = train_step(fused, input_ids=ids, **kw)
            assert (got[1] if isinstance(got, tuple) else got.logits) is None, how  # never formed
            torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6, msg=how)
            assert got_grads.keys() == want_grads.keys(), how
            for name, grad in want_grads.items():
                torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=f"{how}: {name}")
        # evaluation (and an explicit skip_logits=False) keeps the logits: the loss on them is vtp's
        fused.eval(), reference.eval()
        want = reference(input_ids=ids, labels=labels)
        for got in (
            fused(input_ids=ids, labels=labels),
            fused.train()(input_ids=ids, labels=labels, skip_logits=False),
        ):
            torch.testing.assert_close(got.logits, want.logits)
            torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
        # no labels: the usual logits, whatever the mode
        torch.testing.assert_close(fused(input_ids=ids).logits, reference(input_ids=ids).logits)
        # eval with skip_logits=True: fused, without gradients
        fused.eval()
        with torch.no_grad():
            out = fused(input_ids=ids, labels=labels, skip_logits=True)
        assert out.logits is None
        torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)


def test_generate_is_unchanged():
    """Generation runs the model's own forward (no labels), in training mode too, and
    ``generate`` reads the model's own signature through the patch; with
    ``use_vocab_parallel_sampling`` on the fused model as well (greedy: the unpatched model's
    sequences; sampled: the unfused model's with the same sampler and seed)."""
    import warnings

    from vtp_runtime.integrations.generation import use_vocab_parallel_sampling
    from vtp_runtime.integrations.transformers import fuse_lm_head

    model = tiny_causal_lm("Llama", pad_token_id=0, eos_token_id=1)
    ids = torch.randint(2, 101, (2, 5), generator=torch.Generator().manual_seed(4))
    kw = {"max_new_tokens": 4, "do_sample": False}
    sampled = {"max_new_tokens": 6, "do_sample": True, "top_p": 0.9}
    want = model.generate(ids, **kw)
    unfused = use_vocab_parallel_sampling(copy.deepcopy(model), seed=5)
    with vtp.use_backend("eager"):
        want_sampled = unfused.generate(ids, **sampled)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(fuse_lm_head(model).train().generate(ids, **kw), want)
        use_vocab_parallel_sampling(model, seed=5)
        with vtp.use_backend("eager"):
            assert torch.equal(model.generate(ids, **kw), want)
            got = model.generate(ids, **sampled)
    assert not [w for w in caught if "shard of the vocabulary" in str(w.message)]  # one process: a whole head
    assert torch.equal(got, want_sampled)
    assert got.shape[1] > want.shape[1] and not torch.equal(got[:, : want.shape[1]], want)  # it did sample


def test_fuse_is_idempotent_and_reversible():
    from vtp_runtime.integrations.transformers import VtpCausalLMLoss, fuse_lm_head, is_fused, unfuse_lm_head

    model = tiny_causal_lm("Llama")
    default_loss = model.loss_function
    assert fuse_lm_head(model) is model and is_fused(model)
    forward = model.forward
    assert fuse_lm_head(model).forward == forward  # a second call changes nothing
    assert isinstance(model.loss_function, VtpCausalLMLoss)
    with pytest.raises(ValueError, match="other arguments"):
        fuse_lm_head(model, chunk_rows=4)
    unfuse_lm_head(model)
    assert not is_fused(model) and "forward" not in model.__dict__ and model.loss_function is default_loss
    assert unfuse_lm_head(model) is model  # not fused: nothing to do

    # a patch on top of ours is not silently dropped
    fuse_lm_head(model)
    inner = model.forward
    model.forward = lambda *a, **k: inner(*a, **k)
    with pytest.raises(RuntimeError, match="wrapped again"):
        unfuse_lm_head(model)


def test_a_copy_of_a_fused_model_runs_on_its_own_weights():
    """A deep copy (TRL's reference model, ``copy.deepcopy(model)``) is fused and computes
    with its own weights, with labels and without (the logits of the copy, not of the model
    it was copied from)."""
    from vtp_runtime.integrations.transformers import fuse_lm_head, is_fused

    model = fuse_lm_head(tiny_causal_lm("Llama"))
    twin, reference = copy.deepcopy(model), tiny_causal_lm("Llama")
    with torch.no_grad():
        for m in (twin, reference):
            m.lm_head.weight.mul_(2)
    assert is_fused(twin)
    ids, labels = small_batch()
    with vtp.use_backend("eager"):
        torch.testing.assert_close(twin(input_ids=ids).logits, reference(input_ids=ids).logits)
    assert_fused_like(twin, reference)


def test_what_cannot_be_fused_is_refused():
    from vtp_runtime.integrations.lm_head import UnfusableLogits
    from vtp_runtime.integrations.transformers import fuse_lm_head

    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        fuse_lm_head(tiny_causal_lm("Gemma2", final_logit_softcapping=30.0))

    class Tanh(torch.nn.Module):  # not an nn.Linear
        def __init__(self, linear):
            super().__init__()
            self.linear = linear

        def forward(self, x):
            return torch.tanh(self.linear(x))

    model = tiny_causal_lm("Llama")
    model.lm_head = Tanh(model.lm_head)
    with pytest.raises(ValueError, match="is a Tanh; vtp_runtime fuses an nn.Linear"):
        fuse_lm_head(model)

    # soft-capping switched on after fusing: the forward raises at its tanh, no number comes out
    model = fuse_lm_head(tiny_causal_lm("Gemma2"))
    model.config.final_logit_softcapping = 30.0
    ids, labels = small_batch()
    with vtp.use_backend("eager"), pytest.raises(UnfusableLogits, match="applies tanh"):
        model(input_ids=ids, labels=labels)
    with pytest.raises(ValueError, match="needs labels"):
        fuse_lm_head(tiny_causal_lm("Llama"))(input_ids=ids, skip_logits=True)


class _Storages(TorchDispatchMode):
    """The largest tensor any op of the block returned, in bytes of memory it spans (its
    elements, or its storage where that is smaller: an expanded stand-in owns almost none),
    and which op returned it."""

    def __init__(self):
        super().__init__()
        self.largest, self.what = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                size = min(t.untyped_storage().nbytes(), t.numel() * t.element_size())
                if size > self.largest:
                    self.largest, self.what = size, (str(func), tuple(t.shape))
        return out


def _largest_storage(model, ids, labels):
    model.zero_grad(set_to_none=True)
    with _Storages() as seen:
        model(input_ids=ids, labels=labels).loss.backward()
    return seen.largest, seen.what


def _memory_case(v_local, vocab):
    """(ids, labels, bound): a batch of N = 256 tokens, and the bytes of half its
    [N, V_local] fp32 logits: the fused step must never hold a tensor that large (a chunk
    of 16 rows and its fp32 temporaries are far below; so are the [V, H] weights and their
    gradients, H = 32)."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, vocab, (8, 32), generator=g)
    return ids, ids.clone(), 256 * v_local * 4 // 2


def test_fused_step_never_allocates_the_logits():
    from vtp_runtime.integrations.transformers import fuse_lm_head

    model = tiny_causal_lm("Llama", vocab_size=V)  # logits well above every activation and weight gradient
    ids, labels, bound = _memory_case(V, V)
    with vtp.use_backend("eager"):
        unfused, what = _largest_storage(model, ids, labels)
        assert unfused >= bound, what  # the model's own step does: the check can fail
        fused, what = _largest_storage(fuse_lm_head(model, chunk_rows=16), ids, labels)
    assert fused < bound, what


def test_trainer_with_gradient_accumulation(tmp_path):
    """transformers' Trainer (num_items_in_batch over two accumulated micro-batches) logs
    the same losses and gradient norms, and leaves the same weights, with the head fused:
    by ``fuse_lm_head``, and by the switch on a model the Trainer builds (``model_init``)."""
    from tests.trainer_job import train
    from vtp_runtime.integrations.transformers import apply_fused_lm_head, fuse_lm_head, is_fused, revert_fused_lm_head

    def assert_same(got, want):
        torch.testing.assert_close(torch.tensor(got["logs"]), torch.tensor(want["logs"]), rtol=1e-5, atol=1e-6)
        for name, w in want["weights"].items():
            torch.testing.assert_close(got["weights"][name], w, rtol=1e-5, atol=1e-6, msg=name)

    built = []

    def model_init():
        built.append(tiny_causal_lm("Llama"))
        return built[-1]

    want = train(tiny_causal_lm("Llama"), str(tmp_path / "hf"))
    assert len(want["logs"]) == 2
    with vtp.use_backend("eager"):
        assert_same(train(fuse_lm_head(tiny_causal_lm("Llama")), str(tmp_path / "vtp")), want)
        apply_fused_lm_head("llama")
        try:
            assert_same(train(model_init, str(tmp_path / "init")), want)
        finally:
            revert_fused_lm_head()
    assert built and all(is_fused(m) for m in built)


# -- two ranks -------------------------------------------------------------------------------------


def _save_job(rank, world, group, path):
    from transformers import LlamaForCausalLM

    if rank == 0:
        torch.manual_seed(0)
        config = tiny_llama_config(V)
        LlamaForCausalLM(config).save_pretrained(path)
    dist.barrier(group)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    pool = RankPool(WORLD, env={"VTP_BACKEND": "eager"})
    path = str(tmp_path_factory.mktemp("llama"))
    pool.run(_save_job, path, timeout=240)  # the first job pays for importing transformers
    yield pool, path
    pool.close()


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (2, 7), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt
    labels[1, -1] = -100  # padding
    return ids, labels


def _load(path, **kw):
    from transformers import LlamaForCausalLM

    # in training mode, where fuse_lm_head fuses (from_pretrained gives eval mode; no dropout here)
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).train()


def _loss_and_grads(model, ids, labels, num_items):
    model.zero_grad(set_to_none=True)
    kw = {} if num_items is None else {"num_items_in_batch": num_items}
    out = model(input_ids=ids, labels=labels, **kw)
    out.loss *= 1  # as transformers' Trainer scales it (average_tokens_across_devices): in place
    out.loss.backward()
    return out, {name: p.grad for name, p in model.named_parameters()}


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _same_as_reference(ref, model, ids, labels, start=None, end=None):
    """The sharded model's loss and gradients against the single process's, with and
    without num_items_in_batch. ``start``/``end``: rows of a plain (hand-split) head weight."""
    outputs = []
    for num_items in (None, torch.tensor(9)):
        want, want_grads = _loss_and_grads(ref, ids, labels, num_items)
        got, got_grads = _loss_and_grads(model, ids, labels, num_items)
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
        assert want_grads.keys() == got_grads.keys()
        for name, grad in want_grads.items():  # every rank gathers every DTensor, in the same order
            if start is not None and name == "lm_head.weight":
                grad = grad[start:end]
            torch.testing.assert_close(_full(got_grads[name]), grad, rtol=1e-4, atol=1e-6, msg=name)
        outputs.append(got)
    return outputs


def _tp_plan_job(rank, world, group, path):
    from transformers.distributed import DistributedConfig

    from vtp_runtime.integrations.transformers import fuse_lm_head, use_vocab_parallel_loss

    ref = _load(path)
    ids, labels = _batch()
    chunk = -(-V // world)
    # fused, under the head's "colwise" style and under the default one (which gathers its output)
    for plan in ({"lm_head": "colwise"}, None):
        model = fuse_lm_head(_load(path, distributed_config=DistributedConfig(tp_plan=plan, tp_size=world)))
        for out in _same_as_reference(ref, model, ids, labels):
            assert out.logits is None
        model.eval()
        want = ref(input_ids=ids).logits  # without labels: the logits as the plan gives them
        got = model(input_ids=ids, labels=labels)  # evaluation keeps the logits; the loss is still vtp's
        assert got.logits.shape == (2, 7, min(chunk, V - rank * chunk) if plan else V)
        torch.testing.assert_close(got.loss, ref(input_ids=ids, labels=labels).loss, rtol=1e-5, atol=1e-6)
        if plan is None:
            torch.testing.assert_close(got.logits, want, rtol=1e-5, atol=1e-6)
        # the memory test at TP=2: no [N, V_local] storage in a fused step
        model.train()
        fuse_ids, fuse_labels, bound = _memory_case(min(chunk, V - rank * chunk), V)
        from vtp_runtime.integrations.transformers import unfuse_lm_head

        largest, what = _largest_storage(fuse_lm_head(unfuse_lm_head(model), chunk_rows=16), fuse_ids, fuse_labels)
        assert largest < bound, what

    # the switch: a model loaded after it is fused, on the head its tp_plan shards after __init__
    from vtp_runtime.integrations.transformers import apply_fused_lm_head, is_fused, revert_fused_lm_head

    apply_fused_lm_head("llama")
    try:
        switched = _load(path, distributed_config=DistributedConfig(tp_size=world))
    finally:
        revert_fused_lm_head()
    assert is_fused(switched) and switched._tp_size == world
    for out in _same_as_reference(ref, switched, ids, labels):
        assert out.logits is None

    # the one line that keeps the logits, on the "colwise" plan
    sharded = use_vocab_parallel_loss(
        _load(path, distributed_config=DistributedConfig(tp_plan={"lm_head": "colwise"}, tp_size=world))
    )
    for out in _same_as_reference(ref, sharded, ids, labels):
        assert out.logits.shape == (2, 7, min(chunk, V - rank * chunk))  # local shards, not gathered
    # the default plan gathers the output: that loss refuses it instead of computing garbage
    gathered = use_vocab_parallel_loss(_load(path, distributed_config=DistributedConfig(tp_size=world)))
    try:
        gathered(input_ids=ids, labels=labels)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(300)
def test_tp_plan_lm_head(pool):
    pool, path = pool
    for message in pool.run(_tp_plan_job, path, timeout=240):
        assert "colwise_gather_output" in message


def _colwise_parallel_job(rank, world, group, path):
    """torch's own TP on the head: a DTensor weight, DTensor logits (use_local_output=False)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from vtp_runtime.integrations.transformers import fuse_lm_head, use_vocab_parallel_loss

    ref = _load(path)
    ids, labels = _batch()
    mesh = init_device_mesh("cpu", (world,))
    for use_local_output in (False, True):
        model = _load(path)
        parallelize_module(model, mesh, {"lm_head": ColwiseParallel(use_local_output=use_local_output)})
        for out in _same_as_reference(ref, fuse_lm_head(model), ids, labels):
            assert out.logits is None
        if not use_local_output:  # DTensor logits, taken as they are by the loss that keeps them
            model = _load(path)
            parallelize_module(model, mesh, {"lm_head": ColwiseParallel(use_local_output=False)})
            _same_as_reference(ref, use_vocab_parallel_loss(model), ids, labels)


@pytest.mark.timeout(300)
def test_colwise_parallel_head(pool):
    pool, path = pool
    pool.run(_colwise_parallel_job, path, timeout=240)


class _HandSplitHead(torch.nn.Module):
    """This rank's rows ``[start, end)`` of a full lm_head, with or without the copy into
    the TP region in front of it."""

    def __init__(self, full, start, end, group, copy):
        super().__init__()
        self.weight = torch.nn.Parameter(full.weight.detach()[start:end].clone())
        self.group, self.copy = group, copy

    def forward(self, hidden):
        from vtp_runtime.integrations import copy_to_tp_region

        if self.copy:
            hidden = copy_to_tp_region(hidden, self.group)
        return F.linear(hidden, self.weight)


def _hand_split_job(rank, world, group, path):
    from vtp_runtime.integrations.transformers import fuse_lm_head, use_vocab_parallel_loss

    bounds = [0, SPLIT, V]
    start, end = bounds[rank], bounds[rank + 1]
    ref = _load(path)
    ids, labels = _batch()

    # fused: a plain nn.Linear with this rank's rows, and the layout given
    model = _load(path)
    linear = torch.nn.Linear(32, end - start, bias=False)
    linear.weight = torch.nn.Parameter(model.lm_head.weight.detach()[start:end].clone())
    model.lm_head = linear
    for out in _same_as_reference(ref, fuse_lm_head(model, group, start, end), ids, labels, start, end):
        assert out.logits is None

    wrong = []
    for copy_ in (True, False):
        model = _load(path)
        model.lm_head = _HandSplitHead(model.lm_head, start, end, group, copy_)
        use_vocab_parallel_loss(model, group, start, end)
        for num_items in (None, 9):
            want, want_grads = _loss_and_grads(ref, ids, labels, num_items)
            got, got_grads = _loss_and_grads(model, ids, labels, num_items)
            torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(
                got_grads["lm_head.weight"], want_grads["lm_head.weight"][start:end], rtol=1e-4, atol=1e-6
            )
            backbone = [name for name in want_grads if name != "lm_head.weight"]
            if copy_:
                for name in backbone:
                    torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=name)
            else:
                wrong.append(
                    sum(not torch.allclose(got_grads[n], want_grads[n], rtol=1e-2, atol=1e-4) for n in backbone)
                )
    return wrong, len(backbone)


@pytest.mark.timeout(300)
def test_hand_split_head(pool):
    pool, path = pool
    for wrong, n_backbone in pool.run(_hand_split_job, path, timeout=240):
        # without the copy every backbone gradient is a partial sum: wrong, and nothing says so
        assert wrong == [n_backbone, n_backbone], (wrong, n_backbone)


def test_a_forward_that_bypasses_its_head_module_is_refused():
    """A model projecting with ``self.lm_head.weight`` itself would form the logits anyway:
    the fused forward raises instead of silently materializing them."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from vtp_runtime.integrations.transformers import fuse_lm_head

    model = tiny_causal_lm("Llama")

    def bypassing(self, input_ids=None, labels=None, **kw):
        hidden = self.model(input_ids=input_ids).last_hidden_state
        logits = F.linear(hidden, self.get_output_embeddings().weight)
        return CausalLMOutputWithPast(logits=logits, loss=logits.mean())

    model.forward = bypassing.__get__(model)
    fuse_lm_head(model)
    ids, labels = small_batch()
    with pytest.raises(RuntimeError, match="did not call its output head"):
        model(input_ids=ids, labels=labels)

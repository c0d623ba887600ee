"""transformers: ``apply_fused_lm_head`` (the class-level switch) fuses every model of the
types it names built afterwards -- Llama, Qwen2, Qwen3, Mistral, Gemma, Phi-3, a class
transformers does not know, the Trainer's ``model_init`` -- and every causal LM without a
name, each giving the model's own loss and gradients; it is idempotent and reversible,
refuses what it cannot fuse, and composes with Liger's layer kernels. ``fuse_lm_head`` on one
model: tests/test_integrations_transformers.py."""

import copy
import functools
import importlib.util
import os

import pytest
import torch

import vtp_runtime as vtp
from tests.helpers import TINY_CONFIG, assert_fused_like, small_batch, tiny_causal_lm

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (pip install -e '.[integrations]')",
)


# -- the switch: every model of a class fused as it is built ------------------------------------------

SWITCHED = {
    "Llama": "llama",
    "Qwen2": "qwen2",
    "Qwen3": "qwen3",
    "Mistral": "mistral",
    "Gemma": "gemma",
    "Phi3": "phi3",
}


@pytest.fixture
def switch():
    """``apply_fused_lm_head``, reverted after the test whatever it left on."""
    from vtp_runtime.integrations.transformers import apply_fused_lm_head, revert_fused_lm_head

    yield apply_fused_lm_head
    revert_fused_lm_head()


@pytest.mark.parametrize("family", list(SWITCHED))
def test_switch_fuses_models_built_afterwards(family, switch, tmp_path):
    """``apply_fused_lm_head(model_type)``: a model of that type built afterwards -- by
    ``from_config``, ``from_pretrained``, or a copy of one (a reference model) -- is fused,
    with the unpatched model's loss and gradients; one built before is not."""
    from transformers import AutoModelForCausalLM

    reference = tiny_causal_lm(family)
    reference.save_pretrained(tmp_path)
    switch(SWITCHED[family])
    torch.manual_seed(0)
    built = AutoModelForCausalLM.from_config(reference.config)
    assert_fused_like(built, reference)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert_fused_like(loaded, reference)
    assert_fused_like(copy.deepcopy(loaded), reference)


@functools.cache
def _tiny_class():
    """A causal LM transformers does not know: an embedding, a tanh and a biased head."""
    from transformers import LlamaConfig, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutput

    class TinyForCausalLM(PreTrainedModel):
        config_class = LlamaConfig

        def __init__(self, config):
            super().__init__(config)
            self.embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
            self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size)
            self.post_init()

        def get_output_embeddings(self):
            return self.lm_head

        def forward(self, input_ids, labels=None, **kwargs):
            logits = self.lm_head(torch.tanh(self.embed(input_ids)))
            loss = None if labels is None else self.loss_function(logits, labels, self.config.vocab_size, **kwargs)
            return CausalLMOutput(loss=loss, logits=logits)

    return TinyForCausalLM


def _tiny():
    from transformers import LlamaConfig

    torch.manual_seed(0)
    return _tiny_class()(LlamaConfig(**TINY_CONFIG))


def test_switch_for_every_causal_lm(switch):
    """No argument: every causal LM built afterwards, a class transformers does not know
    included (by its name); one that cannot be fused keeps its logits, with one warning."""
    tiny, qwen = _tiny(), tiny_causal_lm("Qwen2")
    switch()
    assert_fused_like(_tiny(), tiny)
    assert_fused_like(tiny_causal_lm("Qwen2"), qwen)
    with pytest.warns(UserWarning, match="Gemma2ForCausalLM keeps its logits.*final_logit_softcapping") as seen:
        capped = [tiny_causal_lm("Gemma2", final_logit_softcapping=30.0) for _ in range(2)]
    assert len([w for w in seen if "keeps its logits" in str(w.message)]) == 1  # once per class
    ids, labels = small_batch()
    with vtp.use_backend("eager"):
        assert capped[1].train()(input_ids=ids, labels=labels).logits is not None


def test_switch_is_idempotent_reversible_and_refuses_what_it_cannot_fuse(switch):
    from transformers import PreTrainedModel

    from vtp_runtime.integrations.transformers import is_fused, revert_fused_lm_head

    post_init = PreTrainedModel.post_init
    switch("llama", _tiny_class(), chunk_rows=4)
    switch("llama", chunk_rows=4)  # the same again: nothing changes
    with pytest.raises(ValueError, match="already called for LlamaForCausalLM"):
        switch("llama")
    with pytest.raises(ValueError, match="'lama' is not a model_type"):
        switch("lama")
    with pytest.raises(ValueError, match="takes transformers model classes"):
        switch(torch.nn.Linear)
    before = tiny_causal_lm("Qwen2")  # not switched
    switch("gemma2")
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):  # named: refused as it is built
        tiny_causal_lm("Gemma2", final_logit_softcapping=30.0)
    llama = tiny_causal_lm("Llama")
    assert is_fused(llama) and not is_fused(before)
    revert_fused_lm_head("llama")
    assert not is_fused(tiny_causal_lm("Llama")) and is_fused(llama)  # built before the revert: still fused
    assert is_fused(_tiny())
    revert_fused_lm_head()
    assert PreTrainedModel.post_init is post_init  # transformers' own again
    assert not is_fused(_tiny())


def _liger_then_vtp(switch, device: str, **kernels: bool) -> None:
    """Liger's layer kernels with vtp's head, as docs/integrations.md composes them:
    ``apply_liger_kernel_to_llama`` without its cross entropies, then the switch; a Llama
    built afterwards has the loss and gradients of the unpatched one (Liger's module
    patches are undone afterwards)."""
    pytest.importorskip("liger_kernel")
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from transformers.models.llama import modeling_llama

    reference = tiny_causal_lm("Llama").to(device)
    names = ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")
    saved = {name: getattr(modeling_llama, name) for name in names}
    try:
        apply_liger_kernel_to_llama(cross_entropy=False, fused_linear_cross_entropy=False, **kernels)
        patched = [getattr(modeling_llama, name) is not saved[name] for name in names]
        assert patched == [kernels.get(k, True) for k in ("rope", "rms_norm", "swiglu")]
        switch("llama")
        assert_fused_like(tiny_causal_lm("Llama").to(device), reference)
    finally:
        for name, value in saved.items():
            setattr(modeling_llama, name, value)


def test_switch_composes_with_liger_layer_kernels(switch):
    """On CPU only Liger's RoPE runs (in Triton's interpreter; its RMSNorm and SwiGLU
    kernels do not): the two class patches compose. The GPU test runs every layer kernel."""
    _liger_then_vtp(switch, "cpu", rope=True, rms_norm=False, swiglu=False)


@pytest.mark.gpu
def test_switch_composes_with_every_liger_layer_kernel_on_gpu(switch):
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU with compiled Triton: TRITON_INTERPRET=0 python -m pytest -m gpu")
    _liger_then_vtp(switch, "cuda")

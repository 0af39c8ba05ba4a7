"""The coverage corpus: real model classes, built from configs with random
weights (nothing downloaded), each with the training loop its users write.

An :class:`Entry` gives ``build()`` (the module), ``make_batch(batch, generator)``
(CPU tensors: a tuple, or a dict for Hugging Face's ``model(**batch)``) and
``loop(m, batch) -> loss``, one training iteration written as the family's own
examples write it. ``m`` holds ``model``, ``opt`` and ``autocast()``: eager DDP
autocasts the forward and the loss with ``torch.autocast(bf16)``, pygraph_dist
leaves it to ``wrap(amp="bf16")`` (``autocast()`` is then a no-op), as each one's
users do (``bench_scaling.py``'s modes).

Loops:

* ``vision``: ``logits = model(x); loss = F.cross_entropy(logits, y)`` in the loop;
* ``hf``: ``loss = model(**batch).loss`` (a tokenizer/collator batch: ``input_ids``,
  ``attention_mask``, ``labels``; ``pixel_values`` and ``labels`` for images);
* ``word_lm``: PyTorch's ``examples/word_language_model`` (``main.py``): sequence-first
  tokens, ``output = model(data)``, ``NLLLoss`` on ``output.view(-1, ntokens)``,
  ``clip_grad_norm_(params, 0.25)``;
* ``rnn_lm``: the same example's LSTM, with the hidden state carried from batch
  to batch and detached (``repackage_hidden``);
* ``lightning_demo``: Lightning's ``LightningTransformer.training_step``:
  ``output = model(inputs, target); loss = F.nll_loss(output, target.view(-1))``.

Sizes are small on purpose (the whole corpus runs in a few minutes): text
models 2-4 layers, 256 wide, 8 x 128 tokens, a vocabulary of 8192; images
32 x 128 px (224 px for the timm models whose positional tables need it).
Adding a model is one ``register(...)``.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 8192
SEQ = 128
TEXT_BATCH = 8
IMAGE_BATCH = 32
MASK_TOKEN = 4   # the [MASK] id of the masked-LM batches


@dataclass(frozen=True)
class Entry:
    name: str                  # the --models name
    family: str                # torchvision, timm, transformers, torch.nn, lightning
    what: str                  # the class as users know it, e.g. "torchvision.models.resnet18"
    build: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.Generator], object]   # (per-GPU batch, generator) -> CPU batch
    loop: Callable                                         # (m, batch) -> loss
    batch: int
    requires: tuple[str, ...] = ()
    named_only: bool = False   # run only when named exactly (--models hf_albert_default): not in "all" or globs

    def missing(self) -> list[str]:
        return [m for m in self.requires if importlib.util.find_spec(m) is None]


REGISTRY: dict[str, Entry] = {}


def register(e: Entry) -> Entry:
    assert e.name not in REGISTRY, e.name
    REGISTRY[e.name] = e
    return e


def to_device(batch, dev: torch.device):
    if isinstance(batch, dict):
        return {k: v.to(dev) for k, v in batch.items()}
    return tuple(t.to(dev) for t in batch)


# =========================================================================== loops
def loop_vision(m, batch):
    x, y = batch
    m.opt.zero_grad(set_to_none=True)
    with m.autocast():
        logits = m.model(x)
        loss = F.cross_entropy(logits, y)
    loss.backward()
    m.opt.step()
    return loss


def loop_hf(m, batch):
    m.opt.zero_grad(set_to_none=True)
    with m.autocast():
        loss = m.model(**batch).loss
    loss.backward()
    m.opt.step()
    return loss


CLIP = 0.25  # word_language_model's --clip


def loop_word_lm(m, batch):
    data, targets = batch
    m.opt.zero_grad(set_to_none=True)
    with m.autocast():
        output = m.model(data)
        output = output.view(-1, VOCAB)
        loss = F.nll_loss(output, targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(m.model.parameters(), CLIP)
    m.opt.step()
    return loss


def loop_rnn_lm(m, batch):
    data, targets = batch
    hidden = getattr(m, "hidden", None)
    if hidden is None:  # model.init_hidden(batch size)
        shape = (RNN_LAYERS, data.size(1), RNN_WIDTH)
        hidden = (data.new_zeros(shape, dtype=torch.float), data.new_zeros(shape, dtype=torch.float))
    hidden = tuple(h.detach() for h in hidden)  # repackage_hidden
    m.opt.zero_grad(set_to_none=True)
    with m.autocast():
        output, hidden = m.model(data, hidden)
        loss = F.nll_loss(output, targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(m.model.parameters(), CLIP)
    m.opt.step()
    m.hidden = hidden
    return loss


def loop_lightning_demo(m, batch):
    inputs, target = batch
    m.opt.zero_grad(set_to_none=True)
    with m.autocast():
        output = m.model(inputs, target)
        loss = F.nll_loss(output, target.view(-1))
    loss.backward()
    m.opt.step()
    return loss


# =========================================================================== batches
def image_batch(pixels: int, classes: int = 1000, hf: bool = False):
    def make(b: int, g: torch.Generator):
        x = torch.randn(b, 3, pixels, pixels, generator=g)
        y = torch.randint(0, classes, (b,), generator=g)
        return {"pixel_values": x, "labels": y} if hf else (x, y)
    return make


def clm_batch(b: int, g: torch.Generator) -> dict:
    """A causal-LM collator's batch of packed sequences: labels are the inputs."""
    ids = torch.randint(5, VOCAB, (b, SEQ), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def mlm_batch(b: int, g: torch.Generator) -> dict:
    """DataCollatorForLanguageModeling: 15% of the tokens predicted (labels -100
    elsewhere), those replaced by the mask token."""
    ids = torch.randint(5, VOCAB, (b, SEQ), generator=g)
    chosen = torch.rand(b, SEQ, generator=g) < 0.15
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    return {"input_ids": torch.where(chosen, torch.full_like(ids, MASK_TOKEN), ids),
            "attention_mask": torch.ones_like(ids), "labels": labels}


def seq2seq_batch(b: int, g: torch.Generator) -> dict:
    """Source tokens and target labels (the model shifts them into decoder inputs)."""
    ids = torch.randint(5, VOCAB, (b, SEQ), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "labels": torch.randint(5, VOCAB, (b, SEQ // 2), generator=g)}


def seq_cls_batch(b: int, g: torch.Generator) -> dict:
    ids = torch.randint(5, VOCAB, (b, SEQ), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "labels": torch.randint(0, 2, (b,), generator=g)}


def tokens_seq_first(b: int, g: torch.Generator):
    """word_language_model's get_batch: (bptt, batch) inputs, the next tokens flattened as targets."""
    stream = torch.randint(0, VOCAB, (SEQ + 1, b), generator=g)
    return stream[:-1].contiguous(), stream[1:].reshape(-1)


def tokens_batch_first(b: int, g: torch.Generator):
    """Lightning's WikiText2 demo items: (inputs, target) the next tokens, batch first."""
    stream = torch.randint(0, VOCAB, (b, SEQ + 1), generator=g)
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


# =========================================================================== torchvision
def _torchvision(name: str, what: str, builder: Callable[[], nn.Module], pixels: int = 128) -> None:
    register(Entry(name=f"tv_{name}", family="torchvision", what=what, build=builder,
                   make_batch=image_batch(pixels), loop=loop_vision, batch=IMAGE_BATCH,
                   requires=("torchvision",)))


def _tv(fn: str, **kwargs) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision

        return getattr(torchvision.models, fn)(weights=None, **kwargs)
    return build


def _tv_vit() -> nn.Module:
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer(image_size=128, patch_size=16, num_layers=4, num_heads=4, hidden_dim=256,
                             mlp_dim=1024, num_classes=1000)


for _fn in ("resnet18", "resnet50", "mobilenet_v3_small", "mobilenet_v2", "efficientnet_b0", "convnext_tiny",
            "densenet121", "regnet_y_400mf", "swin_t", "shufflenet_v2_x1_0"):
    _torchvision(_fn, f"torchvision.models.{_fn}", _tv(_fn))
_torchvision("vit", "torchvision VisionTransformer (4 x 256, patch 16, 128 px)", _tv_vit)


# =========================================================================== timm
def _timm(name: str, timm_name: str, pixels: int = 128, **kwargs) -> None:
    def build() -> nn.Module:
        import timm

        return timm.create_model(timm_name, pretrained=False, num_classes=1000, **kwargs)

    register(Entry(name=f"timm_{name}", family="timm", what=f"timm.create_model('{timm_name}')", build=build,
                   make_batch=image_batch(pixels), loop=loop_vision, batch=IMAGE_BATCH,
                   requires=("timm", "torchvision")))


_timm("resnet18", "resnet18")
_timm("vit_tiny", "vit_tiny_patch16_224", 224)
_timm("deit_tiny_distilled", "deit_tiny_distilled_patch16_224", 224)
_timm("convnext_atto", "convnext_atto")
_timm("efficientnet_b0", "efficientnet_b0")
_timm("mobilenetv3_small", "mobilenetv3_small_100")
_timm("regnety_002", "regnety_002")
_timm("mixer_s16", "mixer_s16_224", 224)
_timm("levit_128s", "levit_128s", 224)
_timm("ghostnet", "ghostnet_100")


# =========================================================================== transformers
TEXT = dict(vocab_size=VOCAB, hidden_size=256, num_attention_heads=4, intermediate_size=1024,
            max_position_embeddings=512)
DECODER = dict(TEXT, num_hidden_layers=4, num_key_value_heads=2)   # Llama-style, grouped-query attention


def _hf(name: str, model_cls: str, config_cls: str, make_batch, batch: int = TEXT_BATCH, named_only: bool = False,
        **config) -> None:
    def build() -> nn.Module:
        import transformers

        return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config))

    register(Entry(name=f"hf_{name}", family="transformers", what=f"transformers.{model_cls}", build=build,
                   make_batch=make_batch, loop=loop_hf, batch=batch, requires=("transformers",), named_only=named_only))


_hf("bert", "BertForMaskedLM", "BertConfig", mlm_batch, num_hidden_layers=2, **TEXT)
_hf("bert_cls", "BertForSequenceClassification", "BertConfig", seq_cls_batch, num_hidden_layers=2, num_labels=2,
    **TEXT)
_hf("roberta", "RobertaForMaskedLM", "RobertaConfig", mlm_batch, num_hidden_layers=2, **TEXT)
_hf("distilbert", "DistilBertForMaskedLM", "DistilBertConfig", mlm_batch, vocab_size=VOCAB, dim=256, n_layers=2,
    n_heads=4, hidden_dim=1024, max_position_embeddings=512)
_hf("electra", "ElectraForMaskedLM", "ElectraConfig", mlm_batch, embedding_size=128, num_hidden_layers=2, **TEXT)
# DeBERTa-v3's attention: relative positions, disentangled c2p/p2c, shared keys.
_hf("deberta_v2", "DebertaV2ForMaskedLM", "DebertaV2Config", mlm_batch, num_hidden_layers=2,
    relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=256, norm_rel_ebd="layer_norm",
    share_att_key=True, position_biased_input=False, max_relative_positions=-1, **TEXT)
_hf("albert", "AlbertForMaskedLM", "AlbertConfig", mlm_batch, embedding_size=128, num_hidden_layers=4, **TEXT)
_hf("mpnet", "MPNetForMaskedLM", "MPNetConfig", mlm_batch, num_hidden_layers=2, **TEXT)
_hf("gpt2", "GPT2LMHeadModel", "GPT2Config", clm_batch, vocab_size=VOCAB, n_embd=256, n_layer=4, n_head=4,
    n_positions=512, bos_token_id=1, eos_token_id=2)
# Large, compute-bound at this batch (issue 47), run only when named: ALBERT's default
# config (albert-xxlarge's shape: 223M parameters shared by 12 layers) and GPT-2 medium (355M).
_hf("albert_default", "AlbertForMaskedLM", "AlbertConfig", mlm_batch, named_only=True)
_hf("gpt2_medium", "GPT2LMHeadModel", "GPT2Config", clm_batch, named_only=True, n_embd=1024, n_layer=24, n_head=16,
    bos_token_id=1, eos_token_id=2)
_hf("llama", "LlamaForCausalLM", "LlamaConfig", clm_batch, **DECODER)
_hf("mistral", "MistralForCausalLM", "MistralConfig", clm_batch, **DECODER)
# The same with eager attention: no graph-capture branch in transformers' mask (model_notes.py).
_hf("mistral_eager_attn", "MistralForCausalLM", "MistralConfig", clm_batch, named_only=True,
    attn_implementation="eager", **DECODER)
_hf("qwen2", "Qwen2ForCausalLM", "Qwen2Config", clm_batch, **DECODER)
_hf("qwen3", "Qwen3ForCausalLM", "Qwen3Config", clm_batch, head_dim=64, **DECODER)
_hf("gemma", "GemmaForCausalLM", "GemmaConfig", clm_batch, head_dim=64, **DECODER)
_hf("phi3", "Phi3ForCausalLM", "Phi3Config", clm_batch, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    **DECODER)
_hf("opt", "OPTForCausalLM", "OPTConfig", clm_batch, vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4,
    ffn_dim=1024, num_attention_heads=4, word_embed_proj_dim=256, max_position_embeddings=512)
_hf("gpt_neox", "GPTNeoXForCausalLM", "GPTNeoXConfig", clm_batch, num_hidden_layers=4, **TEXT)
_hf("falcon", "FalconForCausalLM", "FalconConfig", clm_batch, vocab_size=VOCAB, hidden_size=256,
    num_hidden_layers=4, num_attention_heads=4)
_hf("bloom", "BloomForCausalLM", "BloomConfig", clm_batch, vocab_size=VOCAB, hidden_size=256, n_layer=4, n_head=4)
_hf("bart", "BartForConditionalGeneration", "BartConfig", seq2seq_batch, vocab_size=VOCAB, d_model=256,
    encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
    encoder_ffn_dim=1024, decoder_ffn_dim=1024, max_position_embeddings=512)
_hf("t5", "T5ForConditionalGeneration", "T5Config", seq2seq_batch, vocab_size=VOCAB, d_model=256, d_kv=64,
    d_ff=1024, num_layers=2, num_decoder_layers=2, num_heads=4, decoder_start_token_id=0, pad_token_id=0)
_hf("vit", "ViTForImageClassification", "ViTConfig", image_batch(128, hf=True), batch=IMAGE_BATCH,
    image_size=128, patch_size=16, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
    intermediate_size=1024, num_labels=1000)
_hf("convnext", "ConvNextForImageClassification", "ConvNextConfig", image_batch(128, hf=True), batch=IMAGE_BATCH,
    hidden_sizes=[64, 128, 256, 512], depths=[2, 2, 2, 2], image_size=128, num_labels=1000)


# =========================================================================== torch.nn
class PositionalEncoding(nn.Module):
    """word_language_model's sinusoidal encoding (a buffer), sequence first."""

    def __init__(self, d_model: int, dropout: float = 0.1, max_len: int = 5000) -> None:
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(1))  # the example's unsqueeze(0).transpose(0, 1), contiguous

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(x + self.pe[:x.size(0), :])


class TransformerWordLM(nn.Module):
    """PyTorch's word-language-model pattern: an ``nn.TransformerEncoder`` fed the
    causal mask ``nn.Transformer.generate_square_subsequent_mask(T).to(device)``,
    made on the host in every ``forward``."""

    def __init__(self, ntoken: int = VOCAB, ninp: int = 256, nhead: int = 4, nhid: int = 1024, nlayers: int = 2,
                 dropout: float = 0.2) -> None:
        super().__init__()
        self.ninp = ninp
        self.input_emb = nn.Embedding(ntoken, ninp)
        self.pos_encoder = PositionalEncoding(ninp, dropout)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(ninp, nhead, nhid, dropout), nlayers)
        self.decoder = nn.Linear(ninp, ntoken)

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(len(src)).to(src.device)
        src = self.pos_encoder(self.input_emb(src) * math.sqrt(self.ninp))
        output = self.decoder(self.encoder(src, mask=mask))
        return F.log_softmax(output, dim=-1)


RNN_LAYERS, RNN_WIDTH = 2, 256


class RNNWordLM(nn.Module):
    """word_language_model's ``RNNModel`` (LSTM): returns the log-probabilities and
    the hidden state the loop feeds into the next batch."""

    def __init__(self, ntoken: int = VOCAB, ninp: int = RNN_WIDTH, nhid: int = RNN_WIDTH, nlayers: int = RNN_LAYERS,
                 dropout: float = 0.2) -> None:
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)

    def forward(self, input: torch.Tensor, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(self.drop(output)).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden


class TrimmedEncoder(nn.Module):
    """A text classifier that trims the padded batch to its longest sequence
    first (``int(attention_mask.sum(1).max())``, a host read of a device value
    that differs from batch to batch), as many hand-written NLP loops do: a
    forward no graph can hold, so every step runs eagerly (issue 47's "a model
    whose capture fails")."""

    def __init__(self, ntoken: int = VOCAB, d: int = 256, nhead: int = 4, nlayers: int = 2, classes: int = 2):
        super().__init__()
        self.emb = nn.Embedding(ntoken, d)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, nhead, 4 * d, 0.1, batch_first=True),
                                             nlayers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, input_ids, attention_mask, labels):
        n = int(attention_mask.sum(1).max())
        ids, mask = input_ids[:, :n], attention_mask[:, :n]
        h = self.encoder(self.emb(ids), src_key_padding_mask=mask == 0)
        pooled = (h * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)
        return F.cross_entropy(self.head(pooled), labels)


def padded_batch(b: int, g: torch.Generator) -> dict:
    """Sequences of random lengths (SEQ/2..SEQ) padded to SEQ, a label each."""
    lengths = torch.randint(SEQ // 2, SEQ + 1, (b,), generator=g)
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    ids = torch.randint(5, VOCAB, (b, SEQ), generator=g) * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 2, (b,), generator=g)}


def loop_loss_returned(m, batch):
    m.opt.zero_grad(set_to_none=True)
    with m.autocast():
        loss = m.model(**batch)
    loss.backward()
    m.opt.step()
    return loss


register(Entry(name="nn_transformer_lm", family="torch.nn",
               what="nn.TransformerEncoder word LM, mask made in forward (PyTorch examples)",
               build=TransformerWordLM, make_batch=tokens_seq_first, loop=loop_word_lm, batch=TEXT_BATCH))
register(Entry(name="nn_lstm_lm", family="torch.nn", what="nn.LSTM word LM, hidden state carried (PyTorch examples)",
               build=RNNWordLM, make_batch=tokens_seq_first, loop=loop_rnn_lm, batch=TEXT_BATCH))
register(Entry(name="nn_trim_padding", family="torch.nn",
               what="nn.TransformerEncoder classifier trimming padding with .item() in forward",
               build=TrimmedEncoder, make_batch=padded_batch, loop=loop_loss_returned, batch=TEXT_BATCH,
               named_only=True))  # made not to capture: not part of the corpus's graphed share


# =========================================================================== Lightning
def _lightning_demo() -> nn.Module:
    from lightning.pytorch.demos import Transformer

    return Transformer(vocab_size=VOCAB, ninp=256, nhead=4, nhid=1024, nlayers=2)


register(Entry(name="lightning_demo", family="lightning",
               what="lightning.pytorch.demos.Transformer (plain loop, its training_step's loss)",
               build=_lightning_demo, make_batch=tokens_batch_first, loop=loop_lightning_demo, batch=TEXT_BATCH,
               requires=("lightning",)))


def select(spec: str | None) -> list[str]:
    """``--models``: comma-separated names, globs (``hf_*``) or names without the
    family prefix (``resnet18`` is ``tv_resnet18`` and ``timm_resnet18``), in
    registry order; SystemExit naming what matched nothing."""
    import fnmatch

    if not spec:
        return [n for n, e in REGISTRY.items() if not e.named_only]
    chosen, unknown = set(), []
    for token in (t.strip() for t in spec.split(",")):
        if not token:
            continue
        hits = [n for n, e in REGISTRY.items() if n == token or n.split("_", 1)[1] == token
                or not e.named_only and fnmatch.fnmatchcase(n, token)]
        if not hits:
            unknown.append(token)
        chosen.update(hits)
    if unknown:
        raise SystemExit(f"unknown model {', '.join(unknown)} (see --list; names: {', '.join(REGISTRY)})")
    return [n for n in REGISTRY if n in chosen]

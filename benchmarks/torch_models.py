"""The benchmark models in plain `torch.nn`, with PyTorch's own TP plans.

The same two workloads as `benchmarks/models.py`, written the way a
PyTorch user would, and split with
`torch.distributed.tensor.parallel.parallelize_module` the way torchtitan
splits its models: q/k/v and the MLP's up projection `ColwiseParallel`,
the attention output and the MLP's down projection `RowwiseParallel`, the
token embedding split by vocabulary rows, the LM head by its outputs with
the logits gathered. Attention reads its head count from the local shapes,
so it runs unchanged on a rank's heads.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.distributed.tensor.parallel import RowwiseParallel
from torch.distributed.tensor.parallel import parallelize_module


class MLPStack(nn.Module):
    """Residual MLP blocks `x + down(gelu(up(x)))`, then a linear head."""

    def __init__(self, features, blocks, classes):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "up": nn.Linear(features, 4 * features),
                    "down": nn.Linear(4 * features, features),
                }
            )
            for _ in range(blocks)
        )
        self.head = nn.Linear(features, classes)

    def forward(self, x):
        for block in self.blocks:
            x = x + block["down"](F.gelu(block["up"](x)))
        return self.head(x)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal attention, then a GELU MLP."""

    def __init__(self, dim, heads):
        super().__init__()
        self.head_dim = dim // heads
        self.ln1 = nn.LayerNorm(dim)
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.attention_output = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp_up = nn.Linear(dim, 4 * dim)
        self.mlp_down = nn.Linear(4 * dim, dim)

    def _heads(self, x):
        batch, length, _ = x.shape
        # -1: the heads this rank holds, once q/k/v are split by columns.
        return x.view(batch, length, -1, self.head_dim).transpose(1, 2)

    def forward(self, x):
        h = self.ln1(x)
        q, k, v = (
            self._heads(p(h)) for p in (self.query, self.key, self.value)
        )
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        batch, _, length, _ = attended.shape
        merged = attended.transpose(1, 2).reshape(batch, length, -1)
        x = x + self.attention_output(merged)
        return x + self.mlp_down(F.gelu(self.mlp_up(self.ln2(x))))


class LanguageModel(nn.Module):
    """The GPT-style LM of `benchmarks/models.py`, in `torch.nn`."""

    def __init__(self, dim, blocks, heads, seq_len, vocab):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, dim)
        self.position_embedding = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(blocks))
        self.final_ln = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.final_ln(x))


def mlp_plan(model):
    """torchtitan-style plan of `MLPStack`: up Colwise, down Rowwise.

    The head is split by its outputs and gathers them, as keras_tp's
    `auto_plan` splits the Keras head.
    """
    plan = {"head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.up"] = ColwiseParallel()
        plan[f"blocks.{i}.down"] = RowwiseParallel()
    return plan


def language_model_plan(model):
    """torchtitan-style plan of `LanguageModel` (Megatron's split)."""
    plan = {
        "token_embedding": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(len(model.blocks)):
        for name in ("query", "key", "value", "mlp_up"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attention_output", "mlp_down"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    return plan


def parallelized(model, plan, mesh):
    """`parallelize_module(model, mesh, plan)`: parameters become DTensors."""
    return parallelize_module(model, mesh, plan)


def train_step(model, optimizer, x, y):
    """One step as a PyTorch user writes it: forward, loss, backward, Adam."""
    optimizer.zero_grad(set_to_none=True)
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    optimizer.step()
    return loss.detach()

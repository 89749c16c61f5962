"""Optional Triton fast paths for the decoder: fused greedy tree verification, tree attention.

`decoding -> kernels` is the one allowed arrow into the kernels package, and it is optional:
both functions here fall back to the PyTorch references inside `lightning_spec.kernels` when
Triton cannot run. Tree attention plugs into a Hugging Face model through transformers'
attention registry, so the target's own layers call our kernel for the verification forward
and the stock SDPA path for everything else (prefill, plain decoding).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_spec.decoding.tree import DraftTree
from lightning_spec.decoding.verify import Verification
from lightning_spec.models.target import TREE_ATTENTION_IMPL as ATTENTION_NAME


def triton_greedy_verifier(tree: DraftTree, target_logits: Tensor) -> Verification:
    """`verify_greedy` through the fused tree-verify kernel (same rule, same tie-break)."""
    from lightning_spec.kernels import tree_verify

    if tree.num_nodes == 0:
        return Verification(
            accepted=torch.zeros(0, dtype=torch.long), bonus_token=int(target_logits[0].argmax())
        )
    argmax = target_logits.argmax(dim=-1)
    length, path, bonus = tree_verify(
        tree.tokens.to(argmax.device), tree.parents.to(argmax.device), argmax
    )
    return Verification(accepted=path[:length].cpu().long(), bonus_token=int(bonus))


def _tree_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    tree_block_mask: Tensor | None = None,
    **kwargs: object,
) -> tuple[Tensor, None]:
    """HF attention function: the tree kernel when a block mask is given, SDPA otherwise.

    `TargetModel.forward` decides which (`kernel_takes_tree_forward`): it passes the block mask
    only when the kernel should run, else the additive mask SDPA reads."""
    new = query.shape[2]
    past = key.shape[2] - new
    if tree_block_mask is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    from lightning_spec.kernels import tree_attention

    out = tree_attention(
        query,
        key[:, :, :past],
        value[:, :, :past],
        key[:, :, past:],
        value[:, :, past:],
        tree_block_mask,
        scale=scaling,
    )
    return out.transpose(1, 2).contiguous(), None


def enable_tree_attention(model: torch.nn.Module) -> None:
    """Route a Hugging Face model's attention through the tree kernel for tree forwards."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, _tree_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    model.set_attn_implementation(ATTENTION_NAME)


def uses_tree_attention(model: torch.nn.Module) -> bool:
    return getattr(model.config, "_attn_implementation", None) == ATTENTION_NAME

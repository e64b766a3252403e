"""TaCL's teacher: a frozen copy of the student's initial encoder, and the fingerprint that proves on
every checkpoint and resume that it is still that copy.

Legend: B sequences, L positions, D hidden size.
"""

from __future__ import annotations

import copy
import hashlib
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import BertModel

    from pipeline.modeling.student import Student


def build_teacher(student: Student, *, dtype: torch.dtype, device: torch.device) -> BertModel:
    """A frozen copy of the student's encoder as it is now (call before training).

    Only the encoder: no vocabulary head (it would cost ~7% more FLOPs for nothing) and no pooler.
    Eval mode (dropout off), no gradients, in the engine's dtype, outside the engine: it has no
    optimizer state and is not in the checkpoint.
    """
    teacher = copy.deepcopy(student.net.bert)
    teacher.pooler = None
    teacher.requires_grad_(False)
    teacher.eval()
    return teacher.to(device=device, dtype=dtype)


def check_teacher(teacher: BertModel, student: Student) -> None:
    assert teacher.config.hidden_size == student.config.hidden_size, (
        teacher.config.hidden_size,
        student.config.hidden_size,
    )


def fingerprint(module: nn.Module) -> str:
    """A short digest of a module's parameters (to check, on resume, that the teacher is rebuilt
    from the same initial weights)."""
    h = hashlib.sha1()
    for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
        h.update(name.encode())
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]

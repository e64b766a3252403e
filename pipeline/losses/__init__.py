"""The pre-training losses as pure tensor functions: MLM and NSP cross-entropy (mlm), TaCL (tacl) and
TACO (taco) with negatives drawn across ranks (sampling, taco_kernel), what they share (common), and
the upstream formulations they are checked against (reference)."""

from pipeline.losses.common import gather_bytes_per_call
from pipeline.losses.mlm import mlm_loss, nsp_loss
from pipeline.losses.tacl import tacl_loss
from pipeline.losses.taco import TACO_POOL_SIZE, taco_loss

__all__ = ["TACO_POOL_SIZE", "gather_bytes_per_call", "mlm_loss", "nsp_loss", "tacl_loss", "taco_loss"]

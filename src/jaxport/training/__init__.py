"""Training machinery shared by the families: optimizers, schedules, EMA."""

from jaxport.training.ema import ema_copy, ema_init, ema_update
from jaxport.training.optimizers import adam_atan2, scale_by_adam_atan2, sparse_sign_sgd_update
from jaxport.training.schedules import compute_lr, cosine_schedule_with_warmup_lr_lambda, warmup_cosine_schedule

__all__ = [
    "adam_atan2",
    "compute_lr",
    "cosine_schedule_with_warmup_lr_lambda",
    "ema_copy",
    "ema_init",
    "ema_update",
    "scale_by_adam_atan2",
    "sparse_sign_sgd_update",
    "warmup_cosine_schedule",
]

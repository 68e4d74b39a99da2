"""Pure per-process math on NCDHW arrays: every op's forward and backward, no MPI.

Signatures follow ``torch.nn.functional`` (weights in PyTorch layout; stride,
padding, dilation, output_padding an int or a 3-tuple), so these functions
serve as the unpartitioned oracle for other implementations.  Ops whose
backward needs global reductions (batch, group, instance and layer norm, losses) are split into local
sums + a finish step, so the distributed layers can allreduce in between.
"""
import sys

from .activations import (leaky_relu, leaky_relu_backward, relu, relu_backward, scaled_tanh,
                          scaled_tanh_backward, tanh, tanh_backward)
from .batch_norm import (batch_norm3d, batch_norm3d_backward, batch_norm_backward,
                         batch_norm_backward_local_sums, batch_norm_forward, batch_norm_local_sums,
                         batch_norm_stats, update_running_stats)
from .conv3d import conv3d, conv3d_backward, conv3d_input_grad, conv3d_weight_grad
from .conv_transpose3d import conv_transpose3d, conv_transpose3d_backward
from .dropout import dropout, dropout_backward, dropout_mask, fold_seed
from .group_norm import (group_norm3d, group_norm3d_backward, group_norm_backward,
                         group_norm_backward_local_sums, group_norm_backward_row_sums,
                         group_norm_forward, group_norm_local_sums,
                         group_norm_stats, instance_norm3d, instance_norm3d_backward)
from .layer_norm import layer_norm3d, layer_norm3d_backward
from .linear import flatten, flatten_backward, linear, linear_backward
from .losses import (cross_entropy_backward, cross_entropy_local_sums, dice_score,
                     dice_score_finish, dice_score_local_sums, log_softmax, mae_local_sums,
                     mae_loss, mae_loss_backward, mean_finish, mse_local_sums, mse_loss,
                     mse_loss_backward, one_hot, soft_dice_backward, soft_dice_finish,
                     soft_dice_local_sums, soft_dice_loss, softmax, softmax_cross_entropy)
from ._route import reference_only
from .pooling import avg_pool3d, avg_pool3d_backward, max_pool3d, max_pool3d_backward

__all__ = [name for name, value in dict(globals()).items()
           if not name.startswith("_") and not isinstance(value, type(sys))]

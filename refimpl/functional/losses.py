"""Losses and the Dice metric, each split around its global reduction.

Every loss ``L`` comes in three pieces so that a partitioned run (samples over
data ranks, voxels over spatial ranks) needs exactly one Allreduce:

    sums = L_local_sums(...)        float64 array, fixed shape, summed over ranks
    loss = L_finish(sums)           python float, identical on every rank
    grad = L_backward(..., sums)    gradient of the *global* loss w.r.t. the local block

and a one-process convenience ``L(...) -> (loss, grad)`` built from them.
Reductions match PyTorch's ``reduction='mean'``:

- mse:  sums = [n, sum (pred - target)^2],  loss = sums[1] / sums[0]
- mae:  sums = [n, sum |pred - target|],    loss = sums[1] / sums[0]   (torch l1_loss; sign(0) = 0)
- softmax cross-entropy over axis 1 with class weights w (torch cross_entropy):
        sums = [sum_v w[y_v], sum_v w[y_v] * (-log softmax(z_v)[y_v])],  loss = sums[1] / sums[0]
- soft Dice on softmax probabilities p and one-hot labels t, per class k summed
  over the batch and all voxels:  I_k = sum p_k t_k, P_k = sum p_k, T_k = sum t_k,
        loss = 1 - (1/K) sum_k (2 I_k + eps) / (P_k + T_k + eps)
- dice_score (metric, no gradient): the same with p = one-hot(argmax z) and eps = 0,
  a class absent from both prediction and labels scoring 1.

Speed: this file is the reference.  On the host with few classes the class passes (the
softmax, the cross-entropy sums and gradient, the hard Dice counts) run
``refimpl/kernels/losses.py``: the same values class plane by class plane over
cache-sized blocks of voxels on worker threads.  The one rule (``_route.kernel_for``): NumPy
logits, C-contiguous, with a spatial axis and at most ``kernels.losses.MASKED_PICK_CLASSES``
classes take the kernel outside ``functional.reference_only()``; everything else the math
below.
"""
from __future__ import annotations

import numpy

from ..backend import array_module, check_same_dtype, to_host
from ..kernels import losses as fast
from ._route import kernel_for
from .args import check_float



def _check_pair(pred, target):
    check_float("pred", pred)
    check_same_dtype(pred=pred, target=target)
    if pred.shape != target.shape:
        raise ValueError(f"target has shape {target.shape} but pred has {pred.shape}")


# ---------------------------------------------------------------- regression
def mse_local_sums(pred, target):
    """[count, sum (pred - target)^2] as float64 (2,)."""
    _check_pair(pred, target)
    xp = array_module(pred, target)
    err = pred - target
    return xp.stack([xp.asarray(float(err.size), dtype=xp.float64),
                     xp.sum(err * err, dtype=xp.float64)])


def mse_loss_backward(pred, target, sums, dloss=1.0):
    """d loss / d pred = 2 (pred - target) / n_global."""
    _check_pair(pred, target)
    return (pred - target) * _per_count(2.0 * dloss, sums, pred.dtype)


def mae_local_sums(pred, target):
    """[count, sum |pred - target|] as float64 (2,)."""
    _check_pair(pred, target)
    xp = array_module(pred, target)
    return xp.stack([xp.asarray(float(pred.size), dtype=xp.float64),
                     xp.sum(xp.abs(pred - target), dtype=xp.float64)])


def mae_loss_backward(pred, target, sums, dloss=1.0):
    """d loss / d pred = sign(pred - target) / n_global."""
    _check_pair(pred, target)
    xp = array_module(pred, target)
    return xp.sign(pred - target) * _per_count(dloss, sums, pred.dtype)


def mean_finish(sums):
    """loss = sums[1] / sums[0] (mse, mae, cross-entropy), a Python float: the one copy of the
    sums to the host (a device -> host synchronisation) of a loss."""
    host = to_host(sums)
    return float(host[1]) / float(host[0])


def _per_count(factor, sums, dtype):
    """``factor / sums[0]`` as a 0-d array of ``dtype``, computed where ``sums`` lives (no
    device -> host copy; the same float32 as ``factor / float(sums[0])``)."""
    return (factor / sums[0]).astype(dtype)


def mse_loss(pred, target):
    """(loss, dpred), loss = mean((pred - target)^2)."""
    sums = mse_local_sums(pred, target)
    return mean_finish(sums), mse_loss_backward(pred, target, sums)


def mae_loss(pred, target):
    """(loss, dpred), loss = mean(|pred - target|)."""
    sums = mae_local_sums(pred, target)
    return mean_finish(sums), mae_loss_backward(pred, target, sums)


# ---------------------------------------------------------------- classification
def _check_logits_labels(logits, labels, class_weights=None, parts=None):
    """Shapes, dtypes and the label range (one scan of ``labels``, skipped where ``parts`` is
    a ``SoftmaxParts`` that validated these very labels against these logits)."""
    check_float("logits", logits)
    if logits.ndim < 2:
        raise ValueError(f"logits must be (N, K, ...), got shape {logits.shape}")
    if labels.ndim != logits.ndim - 1 or labels.shape[0] != logits.shape[0] \
            or labels.shape[1:] != logits.shape[2:]:
        raise ValueError(f"labels must have shape (N, ...) = {(logits.shape[0],) + logits.shape[2:]} "
                         f"for logits of shape {logits.shape}, got {labels.shape}")
    if labels.dtype.kind not in "iu":
        raise ValueError(f"labels must be an integer array, got {labels.dtype}")
    num_classes = logits.shape[1]
    if labels.size and not (parts is not None and parts.checked is labels and parts.logits is logits):
        xp = array_module(labels)
        lo, hi = (int(v) for v in to_host(xp.stack([labels.min(), labels.max()])))   # one sync
        if lo < 0 or hi >= num_classes:
            raise ValueError(f"labels must lie in [0, {num_classes}), got values in [{lo}, {hi}]")
    if class_weights is not None:
        check_same_dtype(logits=logits, class_weights=class_weights)
        if tuple(class_weights.shape) != (num_classes,):
            raise ValueError(f"class_weights must have shape ({num_classes},), got {class_weights.shape}")


def log_softmax(logits):
    """log softmax over the class axis 1, shifted by the max for stability."""
    xp = array_module(logits)
    z = logits - xp.max(logits, axis=1, keepdims=True)
    z -= xp.log(xp.sum(xp.exp(z), axis=1, keepdims=True))
    return z


def softmax(logits):
    """exp(z - max) / sum_k exp(z_k - max) over the class axis 1 (``SoftmaxParts(logits).p``)."""
    return SoftmaxParts(logits).p


class SoftmaxParts:
    """The softmax of logits over the class axis 1, computed once and shared by the pieces of
    a loss (the cross-entropy sums and gradient, the soft Dice sums and gradient):
    ``p = exp(z - lse)`` (N, K, ...) and the log of the normaliser ``lse = log sum_k exp z_k``
    (N, 1, ...).  Each piece would otherwise take its own softmax (most of the loss's time
    then: docs/benchmarks.md, "Timing notes from refimpl/functional/").

    ``labels`` (optional): validated here once against the logits (shape, dtype, range); the
    pieces given these parts and these labels then skip their own scan of the labels.

    ``p = exp(z - m) / sum_k exp(z_k - m)`` with ``m = max_k z_k`` (no overflow), and
    ``lse = log sum_k exp(z_k - m) + m``."""

    def __init__(self, logits, labels=None):
        if labels is not None:
            _check_logits_labels(logits, labels)
        self.logits, self.checked = logits, labels
        kernel = kernel_for(fast, logits)
        if kernel is not None:
            self.p, self.lse = kernel.softmax(logits)
            return
        xp = array_module(logits)
        m = xp.max(logits, axis=1, keepdims=True)
        e = logits - m                              # exp(z - max), in place on one temporary
        xp.exp(e, out=e)
        s = xp.sum(e, axis=1, keepdims=True)
        e /= s
        self.p = e                                  # (N, K, ...)
        self.lse = xp.log(s) + m                    # (N, 1, ...)


def softmax_parts(logits, parts=None):
    """``parts`` when given (computed from these logits by the caller), else ``SoftmaxParts(logits)``."""
    return SoftmaxParts(logits) if parts is None else parts


def _at_labels(a, labels):
    """``a[n, labels[n, ...], ...]``: (N, ...) from (N, K, ...)."""
    xp = array_module(a)
    return xp.take_along_axis(a, labels[:, None], axis=1)[:, 0]


def one_hot(labels, num_classes, dtype):
    """(N, ...) integer labels -> (N, K, ...) one-hot in ``dtype``."""
    xp = array_module(labels)
    classes = xp.arange(num_classes).reshape((1, num_classes) + (1,) * (labels.ndim - 1))
    return (labels[:, None] == classes).astype(dtype)


def _label_weights(labels, class_weights, dtype):
    xp = array_module(labels)
    if class_weights is None:
        return xp.ones(labels.shape, dtype=dtype)
    return class_weights[labels]                                  # (N, ...) w[y_v]


def cross_entropy_local_sums(logits, labels, class_weights=None, parts=None):
    """[sum_v w[y_v], sum_v w[y_v] * nll_v] as float64 (2,), with ``nll_v = lse_v - z_{y_v}``
    (``parts``: the ``SoftmaxParts`` of ``logits`` when the caller has them)."""
    _check_logits_labels(logits, labels, class_weights, parts)
    xp = array_module(logits)
    parts = softmax_parts(logits, parts)
    kernel = kernel_for(fast, logits)
    if kernel is not None:
        return kernel.cross_entropy_sums(logits, parts.lse, labels, class_weights)
    nll = parts.lse[:, 0] - _at_labels(logits, labels)           # (N, ...)
    if class_weights is None:                                     # w = 1: no weight array
        return xp.stack([xp.asarray(float(labels.size), dtype=xp.float64),
                         xp.sum(nll, dtype=xp.float64)])
    w = _label_weights(labels, class_weights, logits.dtype)
    return xp.stack([xp.sum(w, dtype=xp.float64), xp.sum(w * nll, dtype=xp.float64)])


def cross_entropy_backward(logits, labels, sums, class_weights=None, dloss=1.0, parts=None):
    """d loss / d logits = w[y] (softmax(z) - onehot(y)) / sum of the target weights.

    Unit weights are not multiplied in (the same floats).  With ``parts``
    (``SoftmaxParts``) their probabilities are used, not recomputed."""
    _check_logits_labels(logits, labels, class_weights, parts)
    p = softmax_parts(logits, parts).p                              # (N, K, ...)
    kernel = kernel_for(fast, logits)
    if kernel is not None:
        return kernel.cross_entropy_grad(p, labels, class_weights, _per_count(dloss, sums, logits.dtype))
    grad = p - one_hot(labels, logits.shape[1], logits.dtype)       # p - onehot(y)
    if class_weights is not None:
        grad *= _label_weights(labels, class_weights, logits.dtype)[:, None]
    grad *= _per_count(dloss, sums, grad.dtype)
    return grad


def softmax_cross_entropy(logits, labels, class_weights=None):
    """(loss, dlogits) = torch.nn.functional.cross_entropy(logits, labels, weight=class_weights)."""
    _check_logits_labels(logits, labels, class_weights)      # before the softmax reads them
    parts = SoftmaxParts(logits)
    sums = cross_entropy_local_sums(logits, labels, class_weights, parts)
    return mean_finish(sums), cross_entropy_backward(logits, labels, sums, class_weights, parts=parts)


# ---------------------------------------------------------------- Dice
def _per_class_sum(a):
    """(N, K, ...) -> (K,) float64: sum over the batch and every voxel."""
    xp = array_module(a)
    return xp.sum(a, axis=(0,) + tuple(range(2, a.ndim)), dtype=xp.float64)


def soft_dice_local_sums(logits, labels, parts=None):
    """[I_k, P_k, T_k] as float64 (3, K) on softmax probabilities (``parts``: as in
    ``cross_entropy_local_sums``)."""
    _check_logits_labels(logits, labels, parts=parts)
    xp = array_module(logits)
    p = softmax_parts(logits, parts).p
    t = one_hot(labels, logits.shape[1], logits.dtype)
    return xp.stack([_per_class_sum(p * t), _per_class_sum(p), _per_class_sum(t)])


def soft_dice_finish(sums, eps=1e-5):
    """1 - mean_k (2 I_k + eps) / (P_k + T_k + eps)."""
    inter, psum, tsum = to_host(sums)                # one device -> host copy
    return float(1.0 - numpy.mean((2 * inter + eps) / (psum + tsum + eps)))


def soft_dice_backward(logits, labels, sums, eps=1e-5, dloss=1.0, parts=None):
    """d loss / d logits through the softmax.

    dL/dp_kv = -(1/K) (2 t_kv (P_k + T_k + eps) - (2 I_k + eps)) / (P_k + T_k + eps)^2,
    dL/dz_v  = p_v * (g_v - sum_k p_kv g_kv)   (softmax Jacobian-vector product).
    """
    _check_logits_labels(logits, labels, parts=parts)
    xp = array_module(logits)
    num_classes = logits.shape[1]
    shape = (1, num_classes) + (1,) * (logits.ndim - 2)
    numer = (2 * sums[0] + eps).astype(logits.dtype).reshape(shape)
    denom = (sums[1] + sums[2] + eps).astype(logits.dtype).reshape(shape)
    p = softmax_parts(logits, parts).p
    t = one_hot(labels, num_classes, logits.dtype)
    g = (2 * t * denom - numer) / (denom * denom) * (-dloss / num_classes)
    return p * (g - xp.sum(p * g, axis=1, keepdims=True))


def soft_dice_loss(logits, labels, eps=1e-5):
    """(loss, dlogits) of the soft Dice loss on softmax(logits) (see the module doc)."""
    _check_logits_labels(logits, labels)                     # before the softmax reads them
    parts = SoftmaxParts(logits)
    sums = soft_dice_local_sums(logits, labels, parts)
    return soft_dice_finish(sums, eps), soft_dice_backward(logits, labels, sums, eps, parts=parts)


def dice_score_local_sums(logits, labels, parts=None):
    """[|pred_k & label_k|, |pred_k|, |label_k|] as float64 (3, K), pred = argmax over classes
    (``parts``: a ``SoftmaxParts`` that validated ``labels``, whose scan is then skipped)."""
    _check_logits_labels(logits, labels, parts=parts)
    xp = array_module(logits)
    k = logits.shape[1]
    # the confusion matrix in one bincount: row = label, column = prediction
    kernel = kernel_for(fast, logits)
    if kernel is not None:
        confusion = kernel.confusion(logits, labels)
    else:
        pred = xp.argmax(logits, axis=1).reshape(-1)                # (N * D * H * W,) class ids (first max)
        confusion = xp.bincount(labels.reshape(-1) * k + pred, minlength=k * k).reshape(k, k)
    counts = [xp.diagonal(confusion), confusion.sum(axis=0), confusion.sum(axis=1)]   # exact integers
    return xp.stack([c.astype(xp.float64) for c in counts])


def dice_score_finish(sums):
    """Per-class hard Dice 2|A & B| / (|A| + |B|) as a NumPy (K,) array; 1 where both are empty."""
    inter, psum, tsum = to_host(sums)                # one device -> host copy
    total = psum + tsum
    return numpy.where(total > 0, 2 * inter / numpy.maximum(total, 1), 1.0)


def dice_score(logits, labels):
    """Per-class hard Dice of argmax(logits) against labels, NumPy (K,) float64."""
    return dice_score_finish(dice_score_local_sums(logits, labels))


__all__ = ["mse_local_sums", "mse_loss_backward", "mse_loss", "mae_local_sums", "mae_loss_backward",
           "mae_loss", "mean_finish", "log_softmax", "softmax", "SoftmaxParts", "one_hot",
           "cross_entropy_local_sums", "cross_entropy_backward", "softmax_cross_entropy",
           "soft_dice_local_sums", "soft_dice_finish", "soft_dice_backward", "soft_dice_loss",
           "dice_score_local_sums", "dice_score_finish", "dice_score"]

"""AdaLomo's arithmetic on a flat slice of a parameter, apart from where the slice comes from and
where it goes (adalomo.py): which rows and columns of a factored tensor a slice covers, their sums
of squares, the second moments' moving averages, u = g / sqrt(v) and the per-parameter
coefficients. The rule itself is in adalomo.py's docstring."""
from __future__ import annotations

import math

import torch

Pieces = list[tuple[int, int, int, int, int]]


def row_pieces(start: int, n: int, cols: int) -> Pieces:
    """Split the flat slice [start, start + n) of a row-major matrix with `cols` columns into at
    most three rectangles: a partial first row, whole rows, a partial last row.
    Each piece is (offset in the slice, first row, first column, rows, width)."""
    pieces, pos = [], 0
    while pos < n:
        row, col = divmod(start + pos, cols)
        if col == 0 and n - pos >= cols:
            rows, width = (n - pos) // cols, cols
        else:
            rows, width = 1, min(cols - col, n - pos)
        pieces.append((pos, row, col, rows, width))
        pos += rows * width
    return pieces


def is_factored(shape: torch.Size) -> bool:
    return len(shape) >= 2


def factored_pieces(start: int, n: int, shape: torch.Size) -> Pieces:
    """row_pieces of a flat slice of a factored tensor seen as its stacked matrices' rows [E.. x R, C],
    each piece within one matrix, with its column index into the stacked column sums [E.. x C]
    (matrix e's column j is e * C + j). For a 2-D tensor, row_pieces itself."""
    rows_per, cols = shape[-2], shape[-1]
    pieces = []
    for pos, row, col, rows, width in row_pieces(start, n, cols):
        while rows:
            matrix = row // rows_per
            take = min(rows, (matrix + 1) * rows_per - row)
            pieces.append((pos, row, matrix * cols + col, take, width))
            pos, row, rows = pos + take * width, row + take, rows - take
    return pieces


def factor_sizes(shape: torch.Size) -> tuple[int, int]:
    """Elements of a factored tensor's row and column second moments: [E.., R] and [E.., C]."""
    return math.prod(shape[:-1]), math.prod(shape[:-2]) * shape[-1]


def add_row_col_sums(g: torch.Tensor, pieces: Pieces, row_sums: torch.Tensor, col_sums: torch.Tensor) -> None:
    """Add the row and column sums of g^2 of the elements `pieces` tile (factored_pieces of g's
    place in its slice) into the stacked row and column sums."""
    device = row_sums.device
    for pos, row, col, rows, w in pieces:
        block = g[pos:pos + rows * w].view(rows, w)
        row_sums[row:row + rows] += torch.linalg.vector_norm(block, dim=1).square_().to(device)
        col_sums[col:col + w] += torch.linalg.vector_norm(block, dim=0).square_().to(device)


def beta_at(step: torch.Tensor, decay_rate: float) -> torch.Tensor:
    """beta_t = 1 - t^decay_rate (fp64, as a Python float was; t counts from 1)."""
    return 1.0 - step.clamp(min=1.0).pow(decay_rate)


def ema_where(state: torch.Tensor, new: torch.Tensor, beta: torch.Tensor, keep: torch.Tensor) -> None:
    """state = beta state + (1 - beta) new where `keep`, else left as it was (`new` may be NaN)."""
    state.copy_(torch.where(keep, state * beta + new * (1.0 - beta), state))


def factors_of(row: torch.Tensor, col: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1/sqrt(v) of a factored tensor as its row and column factors, v = outer(r, c) / mean(r) with
    mean(r) per matrix (the one matrix of a 2-D tensor); both flat, as factored_pieces indexes them."""
    return (row / row.mean(dim=-1, keepdim=True)).rsqrt_().view(-1), col.rsqrt().view(-1)


def u_of(g: torch.Tensor, pieces: Pieces | None, factors, sq: torch.Tensor | None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """u = g / sqrt(v) into `out` (default: in place of g): by the row and column `factors` over
    `pieces` (factored), or by the full second moment `sq` of g's elements (a vector)."""
    out = g if out is None else out
    if factors is None:
        return torch.mul(g, sq.rsqrt(), out=out)
    row_factor, col_factor = factors
    for pos, row, col, n_rows, w in pieces:
        block = g[pos:pos + n_rows * w].view(n_rows, w)
        dst = out[pos:pos + n_rows * w].view(n_rows, w)
        torch.mul(block, row_factor[row:row + n_rows, None], out=dst).mul_(col_factor[col:col + w])
    return out


def coefficients(weight_sq: torch.Tensor, u_sq: torch.Tensor, numels: torch.Tensor, keep: torch.Tensor,
                 lr: float, weight_decay: float, eps2: float, clip_threshold: float):
    """Each parameter's (coef, decay, step) from its sums of θ^2 and u^2 over the whole tensor:
    step = lr max(eps2, RMS(θ)), coef = step / max(1, RMS(u) / clip_threshold), decay = 1 - step
    weight_decay; a dropped bucket (`keep` false) gets coef 0 and decay 1."""
    step = weight_sq.div(numels).sqrt_().clamp_(min=eps2).mul_(lr)
    clip = u_sq.div(numels).sqrt_().div_(clip_threshold).clamp_(min=1.0)
    coef = torch.where(keep, step / clip, 0.0)
    decay = torch.where(keep, 1.0 - step * weight_decay, 1.0)
    return coef, decay


def update_factored(row: torch.Tensor, col: torch.Tensor, row_sums: torch.Tensor, col_sums: torch.Tensor,
                    shape: torch.Size, eps1: float, beta: torch.Tensor, keep: torch.Tensor):
    """r and c (the state, on their own device) = their moving averages with this step's row and
    column means of g^2 + eps1, from the bucket's reduced row and column sums of g^2; returns the
    means."""
    rows, cols = shape[-2:]
    row_mean = row_sums.div(cols).add_(eps1).to(row.device)
    col_mean = col_sums.div(rows).add_(eps1).to(col.device)
    ema_where(row, row_mean.view_as(row), beta, keep)
    ema_where(col, col_mean.view_as(col), beta, keep)
    return row_mean, col_mean

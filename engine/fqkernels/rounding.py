"""fp32 arithmetic with each rounding where the code puts it.

Triton contracts a multiply and a following add into one FMA, and folds `tl.dot(a, b) + c` into
a product chain that starts from c; where the bits must be those of a reference that rounds each
operation on its own (the gated norm's mean, the exact GDN step's chains), the operation is
written in PTX, which neither pass touches. Under Triton's interpreter (INTERPRETED) they are
the plain operations, which numpy rounds one at a time anyway.
"""
import triton
import triton.language as tl


@triton.jit
def mul_rn(a, b, INTERPRETED: tl.constexpr):
    """a * b rounded on its own: never contracted with a following add into an FMA (PTX mul.rn)."""
    if INTERPRETED:
        return a * b
    else:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def add_rn(a, b, INTERPRETED: tl.constexpr):
    """a + b as its own rounding: Triton folds dot(x, y) + c into dot(x, y, c), a chain that
    starts from c instead of zero (other bits); an add written in PTX is not folded."""
    if INTERPRETED:
        return a + b
    else:
        return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def sub_rn(a, b, INTERPRETED: tl.constexpr):
    """a - b as its own rounding (add_rn's reason)."""
    if INTERPRETED:
        return a - b
    else:
        return tl.inline_asm_elementwise("sub.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)




@triton.jit
def tile_row(x, rows, j):
    """Row j of the register tile x [M, N] as [N] (a sum of one value and zeros: exact)."""
    return tl.sum(tl.where(rows[:, None] == j, x, 0.0), axis=0)

"""The ONNX operators exported graphs may use — the one allow-list, checked on every export.

Why these: QAIC's authoritative list is what `qaic-compile -operators-supported=onnx` writes
(OnnxSupportedOperators.txt), which needs the SDK. Without it we keep to the operators
QEfficient's own Gemma/Llama exports use (MatMul, Softmax, Gather(ND), ScatterND, Where,
elementwise math, shape plumbing, Cast, ...) plus the few elementwise and reduction ops the
packed vision tower lowers to. Deliberately absent:

- `Einsum`: Qualcomm's docs name it as not directly supported (their model preparator rewrites
  it); `ref` writes matmuls instead.
- `Loop`, `Scan`, `If`: block counts are compile-time constants, so block loops are unrolled.
- `Gelu`: an opset-20 op; exports use opset 18, where GELU lowers to Tanh arithmetic.
- `DynamicQuantizeLinear`, `NonZero`, `Unique`, ...: data-dependent shapes.

To widen the list, add the op here with the reason in a comment, after checking it against
OnnxSupportedOperators.txt of the SDK you target.
"""

OPSET = 18

ALLOWED_OPS = frozenset(
    {
        # linear algebra
        "MatMul",
        "Gemm",
        # elementwise arithmetic and math
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Neg",
        "Abs",
        "Pow",
        "Sqrt",
        "Reciprocal",
        "Exp",
        "Log",
        "Tanh",
        "Erf",
        "Sigmoid",
        "Sin",
        "Cos",
        "Max",
        "Min",
        "Clip",
        "Floor",
        "Ceil",
        "Sign",
        # comparisons, logic, selection
        "Equal",
        "Less",
        "LessOrEqual",
        "Greater",
        "GreaterOrEqual",
        "And",
        "Or",
        "Not",
        "Xor",
        "Where",
        "IsInf",
        "IsNaN",
        # reductions and normalization
        "ReduceSum",
        "ReduceMean",
        "ReduceMax",
        "ReduceMin",
        # jax2onnx's ScatterND lowering computes the update count from a shape; static
        # shapes make it a compile-time constant
        "ReduceProd",
        "Softmax",
        # each row's last valid position (QEfficient's causal-LM graphs gather their logits
        # at `position_ids.argmax(1)` too) and the MoE router's top-k experts (QEfficient's
        # MoE exports use TopK)
        "ArgMax",
        "TopK",
        # indexing and the KV cache
        "Gather",
        "GatherElements",
        "GatherND",
        "ScatterND",
        "ScatterElements",
        # shape plumbing
        "Reshape",
        "Transpose",
        "Concat",
        "Split",
        "Slice",
        "Squeeze",
        "Unsqueeze",
        "Expand",
        "Tile",
        "Shape",
        "Range",
        "Constant",
        "ConstantOfShape",
        "Identity",
        "Cast",
        "CumSum",
    }
)

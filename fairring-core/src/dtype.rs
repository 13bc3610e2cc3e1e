//! Element types and reduction operators, as every layer names them.

use crate::named_enum::named_enum;

named_enum! {
    /// The element type of a tensor.
    ///
    /// The discriminants are stable: they travel in frames and through the C ABI.
    pub enum DataType {
        /// IEEE 754 binary32.
        F32 = 0 => "f32",
        /// IEEE 754 binary64.
        F64 = 1 => "f64",
        /// IEEE 754 binary16; reduced in `f32` precision.
        F16 = 2 => "f16",
        /// bfloat16; reduced in `f32` precision.
        BF16 = 3 => "bf16",
        /// Two's-complement 32-bit integer.
        I32 = 4 => "i32",
        /// Two's-complement 64-bit integer.
        I64 = 5 => "i64",
        /// Unsigned 8-bit integer.
        U8 = 6 => "u8",
        /// Two's-complement 8-bit integer.
        I8 = 7 => "i8",
        /// Two's-complement 16-bit integer.
        I16 = 8 => "i16",
        /// A boolean in one byte (PyTorch's `torch.bool`): 0 is false, any
        /// other value true; every combined result is 0 or 1 (a job of one
        /// rank combines nothing and leaves the bytes as they are). Sum and
        /// max reduce as logical or, product and min as logical and.
        Bool = 9 => "bool",
    }
}

impl DataType {
    /// Size of one element in bytes: 1, 2, 4 or 8, so it always divides
    /// [`ALIGN_BYTES`](crate::plan::ALIGN_BYTES).
    pub const fn size_bytes(self) -> u64 {
        match self {
            DataType::U8 | DataType::I8 | DataType::Bool => 1,
            DataType::F16 | DataType::BF16 | DataType::I16 => 2,
            DataType::F32 | DataType::I32 => 4,
            DataType::F64 | DataType::I64 => 8,
        }
    }

    /// Whether the type is a floating-point type.
    pub const fn is_float(self) -> bool {
        matches!(
            self,
            DataType::F32 | DataType::F64 | DataType::F16 | DataType::BF16
        )
    }
}

named_enum! {
    /// A reduction operator.
    ///
    /// `Avg` reduces as `Sum` and is finished by dividing by the number of contributors
    /// ([`crate::reduce::finish_avg`]); it is defined for floating-point types only.
    /// The bitwise operators are defined for integer types and `bool` only.
    pub enum ReduceOp {
        /// Sum (wrapping for integers).
        Sum = 0 => "sum",
        /// Product (wrapping for integers).
        Product = 1 => "product",
        /// Minimum; NaN-propagating for floats.
        Min = 2 => "min",
        /// Maximum; NaN-propagating for floats.
        Max = 3 => "max",
        /// Mean over the contributors: a sum, then a division. Floats only.
        Avg = 4 => "avg",
        /// Bitwise and; logical and on `bool`.
        BitAnd = 5 => "band",
        /// Bitwise or; logical or on `bool`.
        BitOr = 6 => "bor",
        /// Bitwise exclusive or; logical exclusive or on `bool`.
        BitXor = 7 => "bxor",
    }
}

impl ReduceOp {
    /// Whether `self` is defined on `dtype`. `Avg` is defined on floats only: an
    /// integer mean would truncate, and a job that wants it should sum and divide
    /// where it can choose the rounding. The bitwise operators are defined on
    /// integers and `bool` only, as in PyTorch. The others are defined on every
    /// type.
    pub const fn supports(self, dtype: DataType) -> bool {
        match self {
            ReduceOp::Avg => dtype.is_float(),
            ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor => !dtype.is_float(),
            ReduceOp::Sum | ReduceOp::Product | ReduceOp::Min | ReduceOp::Max => true,
        }
    }

    /// Whether `self` is one of the bitwise operators.
    pub const fn is_bitwise(self) -> bool {
        matches!(self, ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor)
    }
}

named_enum! {
    /// How the `f32` values of a reduction travel between machines.
    ///
    /// The discriminants are stable: they travel in operation descriptors and
    /// through the C ABI.
    pub enum WireFormat {
        /// As they are: every bit of every value arrives.
        Exact = 0 => "exact",
        /// Rounded to bfloat16 (8 significant bits, `f32`'s range): half the
        /// bytes, a relative error of at most 2^-8 per rounding.
        Bf16 = 1 => "bf16",
        /// Rounded to IEEE binary16 (11 significant bits, largest finite
        /// 65504, subnormal below 2^-14): half the bytes, a relative error of at
        /// most 2^-11 per rounding for values within its range.
        F16 = 2 => "f16",
    }
}

impl WireFormat {
    /// Whether values of `dtype` may travel in this format: [`WireFormat::Exact`]
    /// carries every type; the compressed formats carry `f32` only (narrowing
    /// an integer would change it, and the half types are already 16 bits).
    pub const fn carries(self, dtype: DataType) -> bool {
        matches!(self, WireFormat::Exact) || matches!(dtype, DataType::F32)
    }

    /// Bytes one `f32` takes on the wire: 4, or 2 when compressed.
    pub const fn f32_bytes(self) -> usize {
        match self {
            WireFormat::Exact => 4,
            WireFormat::Bf16 | WireFormat::F16 => 2,
        }
    }

    /// Bytes on the wire of `bytes` bytes of values: `bytes` itself when
    /// exact (any type), else [`WireFormat::f32_bytes`] per `f32`.
    pub const fn wire_bytes(self, bytes: usize) -> usize {
        match self {
            WireFormat::Exact => bytes,
            compressed => bytes / 4 * compressed.f32_bytes(),
        }
    }
}

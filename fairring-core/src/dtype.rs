//! Element types and reduction operators, as every layer names them.

use core::fmt;

/// The element type of a tensor.
///
/// The discriminants are stable: they travel in frames and through the C ABI.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DataType {
    /// IEEE 754 binary32.
    F32 = 0,
    /// IEEE 754 binary64.
    F64 = 1,
    /// IEEE 754 binary16; reduced in `f32` precision.
    F16 = 2,
    /// bfloat16; reduced in `f32` precision.
    BF16 = 3,
    /// Two's-complement 32-bit integer.
    I32 = 4,
    /// Two's-complement 64-bit integer.
    I64 = 5,
    /// Unsigned 8-bit integer.
    U8 = 6,
    /// Two's-complement 8-bit integer.
    I8 = 7,
}

impl DataType {
    /// Every element type, in discriminant order.
    pub const ALL: [DataType; 8] = [
        DataType::F32,
        DataType::F64,
        DataType::F16,
        DataType::BF16,
        DataType::I32,
        DataType::I64,
        DataType::U8,
        DataType::I8,
    ];

    /// Size of one element in bytes: 1, 2, 4 or 8, so it always divides
    /// [`ALIGN_BYTES`](crate::plan::ALIGN_BYTES).
    pub const fn size_bytes(self) -> u64 {
        match self {
            DataType::U8 | DataType::I8 => 1,
            DataType::F16 | DataType::BF16 => 2,
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

    /// The type with this discriminant, if there is one.
    pub const fn from_u8(value: u8) -> Option<DataType> {
        match value {
            0 => Some(DataType::F32),
            1 => Some(DataType::F64),
            2 => Some(DataType::F16),
            3 => Some(DataType::BF16),
            4 => Some(DataType::I32),
            5 => Some(DataType::I64),
            6 => Some(DataType::U8),
            7 => Some(DataType::I8),
            _ => None,
        }
    }

    /// The lower-case name used in errors, tables and command lines (`f32`, `bf16`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DataType::F32 => "f32",
            DataType::F64 => "f64",
            DataType::F16 => "f16",
            DataType::BF16 => "bf16",
            DataType::I32 => "i32",
            DataType::I64 => "i64",
            DataType::U8 => "u8",
            DataType::I8 => "i8",
        }
    }

    /// Parses a name as [`DataType::name`] prints it.
    pub fn from_name(name: &str) -> Option<DataType> {
        DataType::ALL.into_iter().find(|t| t.name() == name)
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A reduction operator.
///
/// `Avg` reduces as `Sum` and is finished by dividing by the number of contributors
/// ([`crate::reduce::finish_avg`]); it is defined for floating-point types only.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    /// Sum (wrapping for integers).
    Sum = 0,
    /// Product (wrapping for integers).
    Product = 1,
    /// Minimum; NaN-propagating for floats.
    Min = 2,
    /// Maximum; NaN-propagating for floats.
    Max = 3,
    /// Mean over the contributors: a sum, then a division. Floats only.
    Avg = 4,
}

impl ReduceOp {
    /// Every operator, in discriminant order.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Product,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
    ];

    /// The operator with this discriminant, if there is one.
    pub const fn from_u8(value: u8) -> Option<ReduceOp> {
        match value {
            0 => Some(ReduceOp::Sum),
            1 => Some(ReduceOp::Product),
            2 => Some(ReduceOp::Min),
            3 => Some(ReduceOp::Max),
            4 => Some(ReduceOp::Avg),
            _ => None,
        }
    }

    /// The lower-case name used in errors, tables and command lines.
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Product => "product",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }

    /// Parses a name as [`ReduceOp::name`] prints it.
    pub fn from_name(name: &str) -> Option<ReduceOp> {
        ReduceOp::ALL.into_iter().find(|op| op.name() == name)
    }

    /// Whether `self` is defined on `dtype`. Every operator is defined on every type
    /// except `Avg` on integers: an integer mean would truncate, and a job that wants
    /// it should sum and divide where it can choose the rounding.
    pub const fn supports(self, dtype: DataType) -> bool {
        !matches!(self, ReduceOp::Avg) || dtype.is_float()
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

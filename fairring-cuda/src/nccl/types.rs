//! fairring's element types and operators as NCCL names them.

use cudarc::nccl::sys::{ncclDataType_t, ncclRedOp_t};
use fairring_core::{DataType, ReduceOp};

use crate::error::{self, Result};

/// The NCCL type of `dtype`; `i16` and `bool` have none (a caller moving
/// their bytes names them `u8`; reductions of them run elsewhere).
pub(crate) fn data_type(dtype: DataType) -> Result<ncclDataType_t> {
    Ok(match dtype {
        DataType::F32 => ncclDataType_t::ncclFloat32,
        DataType::F64 => ncclDataType_t::ncclFloat64,
        DataType::F16 => ncclDataType_t::ncclFloat16,
        DataType::BF16 => ncclDataType_t::ncclBfloat16,
        DataType::I32 => ncclDataType_t::ncclInt32,
        DataType::I64 => ncclDataType_t::ncclInt64,
        DataType::U8 => ncclDataType_t::ncclUint8,
        DataType::I8 => ncclDataType_t::ncclInt8,
        DataType::I16 | DataType::Bool => {
            return Err(error::invalid("dtype", format!("NCCL has no {dtype} type")));
        }
    })
}

/// The NCCL operator for `op` on `dtype`; `Avg` only on float types, as
/// everywhere in fairring (NCCL would truncate an integer mean).
pub(crate) fn reduce_op(op: ReduceOp, dtype: DataType) -> Result<ncclRedOp_t> {
    if !op.supports(dtype) {
        return Err(error::invalid(
            "reduce op",
            format!("{op} is not defined on {dtype}"),
        ));
    }
    Ok(match op {
        ReduceOp::Sum => ncclRedOp_t::ncclSum,
        ReduceOp::Product => ncclRedOp_t::ncclProd,
        ReduceOp::Min => ncclRedOp_t::ncclMin,
        ReduceOp::Max => ncclRedOp_t::ncclMax,
        ReduceOp::Avg => ncclRedOp_t::ncclAvg,
        ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor => {
            return Err(error::invalid(
                "reduce op",
                format!("NCCL has no {op} operator"),
            ));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_maps_to_the_nccl_type_of_its_width() {
        let all = [
            (DataType::F32, ncclDataType_t::ncclFloat32),
            (DataType::F64, ncclDataType_t::ncclFloat64),
            (DataType::F16, ncclDataType_t::ncclFloat16),
            (DataType::BF16, ncclDataType_t::ncclBfloat16),
            (DataType::I32, ncclDataType_t::ncclInt32),
            (DataType::I64, ncclDataType_t::ncclInt64),
            (DataType::U8, ncclDataType_t::ncclUint8),
            (DataType::I8, ncclDataType_t::ncclInt8),
        ];
        for (dtype, nccl) in all {
            assert_eq!(data_type(dtype).unwrap(), nccl);
        }
        for dtype in [DataType::I16, DataType::Bool] {
            let e = data_type(dtype).unwrap_err().to_string();
            assert!(e.contains(dtype.name()), "{e}");
        }
        let e = reduce_op(ReduceOp::BitXor, DataType::I32)
            .unwrap_err()
            .to_string();
        assert!(e.contains("bxor"), "{e}");
        // NCCL's numbering, from nccl.h: the ABI the library is called with.
        assert_eq!(ncclDataType_t::ncclInt8 as u32, 0);
        assert_eq!(ncclDataType_t::ncclFloat32 as u32, 7);
        assert_eq!(ncclDataType_t::ncclBfloat16 as u32, 9);
        assert_eq!(ncclRedOp_t::ncclAvg as u32, 4);
    }

    #[test]
    fn avg_is_refused_on_integers_and_named() {
        assert_eq!(
            reduce_op(ReduceOp::Avg, DataType::F16).unwrap(),
            ncclRedOp_t::ncclAvg
        );
        let e = reduce_op(ReduceOp::Avg, DataType::I64)
            .unwrap_err()
            .to_string();
        assert!(e.contains("avg") && e.contains("i64"), "{e}");
        assert_eq!(
            reduce_op(ReduceOp::Max, DataType::U8).unwrap(),
            ncclRedOp_t::ncclMax
        );
    }
}

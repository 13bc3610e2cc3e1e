//! [`Tensor`] and [`TensorMut`]: the memory a [`Scope`](super::Scope)'s
//! collective reads or writes, host or device alike.
//!
//! On the host a tensor is a borrowed slice (or `Vec`, or array) of any
//! [`Element`], its type the element's. With the `cuda` feature it may be
//! device memory instead, of a stated [`DataType`], ordered on a stream
//! (`TensorMut::device`, `Tensor::device`): the scope's collectives take
//! either, and a call whose tensors disagree (in type, or in where they live)
//! is refused naming the second.

use std::marker::PhantomData;

use fairring_core::DataType;
use fairring_core::reduce::Element;

use super::call::{Call, Memory};
use crate::error::{Error, Result};

/// Memory a collective reads and writes, borrowed for `'a`: a host slice, or
/// device memory ordered on a stream.
#[derive(Debug)]
pub struct TensorMut<'a> {
    place: Place,
    _borrow: PhantomData<&'a mut [u8]>,
}

/// Memory a collective only reads, borrowed for `'a`: a host slice, or
/// device memory ordered on a stream.
#[derive(Debug)]
pub struct Tensor<'a> {
    place: Place,
    _borrow: PhantomData<&'a [u8]>,
}

/// Where a tensor is: `count` elements of `dtype` at `at`, in `memory`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Place {
    pub(super) at: *mut u8,
    pub(super) count: u64,
    pub(super) dtype: DataType,
    memory: Memory,
}

impl<'a> TensorMut<'a> {
    /// `data`, device memory of one GPU holding elements of `dtype`, ordered
    /// on `stream` (a stream of that GPU's primary context): the collective
    /// starts after the work already enqueued there, and
    /// [`Work::enqueue_wait`](crate::Work::enqueue_wait) orders later work
    /// after it. Refused naming `data` if its bytes are not whole elements,
    /// and naming `stream` if it belongs to another GPU.
    #[cfg(feature = "cuda")]
    pub fn device(
        data: &'a mut fairring_cuda::DeviceSliceMut<'_>,
        dtype: DataType,
        stream: &'a fairring_cuda::Stream,
    ) -> Result<TensorMut<'a>> {
        Ok(TensorMut {
            place: Place::device(data.raw(), data.len(), data.device(), dtype, stream)?,
            _borrow: PhantomData,
        })
    }

    /// Where it is.
    pub(super) fn place(&self) -> &Place {
        &self.place
    }
}

impl<'a> Tensor<'a> {
    /// `data`, device memory of one GPU holding elements of `dtype`, ordered
    /// on `stream` (see [`TensorMut::device`]).
    #[cfg(feature = "cuda")]
    pub fn device(
        data: &'a fairring_cuda::DeviceSlice<'_>,
        dtype: DataType,
        stream: &'a fairring_cuda::Stream,
    ) -> Result<Tensor<'a>> {
        Ok(Tensor {
            place: Place::device(data.raw(), data.len(), data.device(), dtype, stream)?,
            _borrow: PhantomData,
        })
    }

    /// Where it is.
    pub(super) fn place(&self) -> &Place {
        &self.place
    }
}

impl Place {
    /// `call` (built from this place's address, count and type) on this
    /// place's memory.
    pub(super) fn placed(&self, call: Call) -> Call {
        Call {
            memory: self.memory,
            ..call
        }
    }

    fn host<T: Element>(at: *const T, len: usize) -> Place {
        Place {
            at: at.cast_mut().cast(),
            count: len as u64,
            dtype: T::DTYPE,
            memory: Memory::Host,
        }
    }

    /// `bytes` of device memory at `address` on GPU `device`, as elements of
    /// `dtype`, ordered on `stream`.
    #[cfg(feature = "cuda")]
    fn device(
        address: u64,
        bytes: usize,
        device: u32,
        dtype: DataType,
        stream: &fairring_cuda::Stream,
    ) -> Result<Place> {
        let size = usize::try_from(dtype.size_bytes()).unwrap_or(usize::MAX);
        if !bytes.is_multiple_of(size) {
            return Err(Error::invalid(
                "data",
                format!("{bytes} bytes are not whole elements of {dtype}"),
            ));
        }
        let on = stream.device().ordinal();
        if device != on {
            return Err(Error::invalid(
                "stream",
                format!("belongs to GPU {on} and the data lies on GPU {device}"),
            ));
        }
        Ok(Place {
            at: address as *mut u8,
            count: (bytes / size) as u64,
            dtype,
            memory: Memory::Device {
                stream: stream.raw(),
            },
        })
    }

    /// Refuses `other`, named `argument`, unless it holds this place's type
    /// in the same memory, ordered alike.
    pub(super) fn check_alike(&self, argument: &'static str, other: &Place) -> Result<()> {
        if other.dtype != self.dtype {
            return Err(Error::invalid(
                argument,
                format!(
                    "holds {} where the other tensor holds {}",
                    other.dtype, self.dtype
                ),
            ));
        }
        if other.memory != self.memory {
            return Err(Error::invalid(
                argument,
                format!(
                    "is {} where the other tensor is {}",
                    describe(other.memory),
                    describe(self.memory)
                ),
            ));
        }
        Ok(())
    }
}

/// Where memory is, in words.
fn describe(memory: Memory) -> &'static str {
    match memory {
        Memory::Host => "host memory",
        #[cfg(feature = "cuda")]
        Memory::Device { .. } => "device memory (ordered on its stream)",
    }
}

impl<'a, T: Element> From<&'a mut [T]> for TensorMut<'a> {
    fn from(data: &'a mut [T]) -> TensorMut<'a> {
        TensorMut {
            place: Place::host(data.as_mut_ptr(), data.len()),
            _borrow: PhantomData,
        }
    }
}

impl<'a, T: Element> From<&'a mut Vec<T>> for TensorMut<'a> {
    fn from(data: &'a mut Vec<T>) -> TensorMut<'a> {
        TensorMut::from(data.as_mut_slice())
    }
}

impl<'a, T: Element, const N: usize> From<&'a mut [T; N]> for TensorMut<'a> {
    fn from(data: &'a mut [T; N]) -> TensorMut<'a> {
        TensorMut::from(data.as_mut_slice())
    }
}

impl<'a, T: Element> From<&'a [T]> for Tensor<'a> {
    fn from(data: &'a [T]) -> Tensor<'a> {
        Tensor {
            place: Place::host(data.as_ptr(), data.len()),
            _borrow: PhantomData,
        }
    }
}

impl<'a, T: Element> From<&'a Vec<T>> for Tensor<'a> {
    fn from(data: &'a Vec<T>) -> Tensor<'a> {
        Tensor::from(data.as_slice())
    }
}

impl<'a, T: Element, const N: usize> From<&'a [T; N]> for Tensor<'a> {
    fn from(data: &'a [T; N]) -> Tensor<'a> {
        Tensor::from(data.as_slice())
    }
}

impl<'a, T: Element> From<&'a mut [T]> for Tensor<'a> {
    fn from(data: &'a mut [T]) -> Tensor<'a> {
        Tensor::from(&*data)
    }
}

impl<'a, T: Element> From<&'a mut Vec<T>> for Tensor<'a> {
    fn from(data: &'a mut Vec<T>) -> Tensor<'a> {
        Tensor::from(data.as_slice())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_tensors_take_their_elements_type_and_length() {
        let mut v = vec![0i64; 7];
        let t = TensorMut::from(&mut v);
        assert_eq!((t.place().count, t.place().dtype), (7, DataType::I64));
        assert_eq!(t.place().memory, Memory::Host);
        let a = [1.0f64; 3];
        let r = Tensor::from(&a);
        assert_eq!((r.place().count, r.place().dtype), (3, DataType::F64));
        assert_eq!(r.place().at.cast_const(), a.as_ptr().cast());
    }

    #[test]
    fn tensors_that_disagree_are_refused_naming_the_argument() {
        let (mut a, b, c) = (vec![0f32; 4], vec![0f32; 8], vec![0i32; 8]);
        let a = TensorMut::from(&mut a);
        assert!(
            a.place()
                .check_alike("output", Tensor::from(&b).place())
                .is_ok()
        );
        match a.place().check_alike("output", Tensor::from(&c).place()) {
            Err(Error::InvalidArgument { argument, reason }) => {
                assert_eq!(argument, "output");
                assert_eq!(reason, "holds i32 where the other tensor holds f32");
            }
            other => panic!("{other:?}"),
        }
        #[cfg(feature = "cuda")]
        {
            let device = Place {
                memory: Memory::Device {
                    stream: std::ptr::null_mut(),
                },
                ..*Tensor::from(&b).place()
            };
            match a.place().check_alike("input", &device) {
                Err(Error::InvalidArgument { argument, reason }) => {
                    assert_eq!(argument, "input");
                    assert!(reason.starts_with("is device memory"), "{reason}");
                }
                other => panic!("{other:?}"),
            }
        }
    }
}

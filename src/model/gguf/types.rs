//! ggml's tensor types: id, name, values per block and bytes per block, one table.
//!
//! The table holds every type a GGUF file can store (ids and sizes as in ggml's
//! `ggml.c` type traits and the `gguf` Python package 0.19.0's `GGML_QUANT_SIZES`), so
//! that the reader bounds-checks any tensor's bytes; which of them phaselens can
//! dequantise is [`GgmlType::dequantizable`]. Ids ggml retired or never stores
//! ([`retired_name`]) and ids beyond the table are errors when a file is opened.

macro_rules! ggml_types {
    ($($v:ident = $id:literal, $bs:literal, $ts:literal, $dq:literal;)*) => {
        /// A ggml tensor type (GGUF's `ggml_type` ids). `Q*_K` and `IQ*` types are
        /// 256-value super-blocks; the others 1 (plain numbers) or 32 values per block.
        #[allow(non_camel_case_types)] // ggml's own names (`Q4_K`), as in every GGUF tool
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum GgmlType {
            $(
                #[doc = concat!("`", stringify!($v), "` (id ", stringify!($id), "): ",
                    stringify!($bs), " values in ", stringify!($ts), " bytes.")]
                $v,
            )*
        }

        impl GgmlType {
            /// Every type, in id order.
            pub const ALL: &'static [GgmlType] = &[$(GgmlType::$v,)*];

            /// The type with ggml id `id`, if it has a layout (see [`retired_name`]).
            pub fn from_id(id: u32) -> Option<GgmlType> {
                match id {
                    $($id => Some(GgmlType::$v),)*
                    _ => None,
                }
            }

            /// ggml's id of the type.
            pub fn id(self) -> u32 {
                match self { $(GgmlType::$v => $id,)* }
            }

            /// Values per block (1 for plain numbers).
            pub fn block_size(self) -> usize {
                match self { $(GgmlType::$v => $bs,)* }
            }

            /// Bytes per block.
            pub fn type_size(self) -> usize {
                match self { $(GgmlType::$v => $ts,)* }
            }

            /// ggml's name of the type (`Q4_K`).
            pub fn name(self) -> &'static str {
                match self { $(GgmlType::$v => stringify!($v),)* }
            }

            /// Whether [`dequantize`](super::dequantize) reads this type.
            pub fn dequantizable(self) -> bool {
                match self { $(GgmlType::$v => $dq,)* }
            }
        }
    };
}

ggml_types! {
    F32 = 0, 1, 4, true;
    F16 = 1, 1, 2, true;
    Q4_0 = 2, 32, 18, true;
    Q4_1 = 3, 32, 20, true;
    Q5_0 = 6, 32, 22, true;
    Q5_1 = 7, 32, 24, true;
    Q8_0 = 8, 32, 34, true;
    Q2_K = 10, 256, 84, true;
    Q3_K = 11, 256, 110, true;
    Q4_K = 12, 256, 144, true;
    Q5_K = 13, 256, 176, true;
    Q6_K = 14, 256, 210, true;
    Q8_K = 15, 256, 292, true;
    IQ2_XXS = 16, 256, 66, false;
    IQ2_XS = 17, 256, 74, false;
    IQ3_XXS = 18, 256, 98, false;
    IQ1_S = 19, 256, 50, false;
    IQ4_NL = 20, 32, 18, false;
    IQ3_S = 21, 256, 110, false;
    IQ2_S = 22, 256, 82, false;
    IQ4_XS = 23, 256, 136, false;
    I8 = 24, 1, 1, false;
    I16 = 25, 1, 2, false;
    I32 = 26, 1, 4, false;
    I64 = 27, 1, 8, false;
    F64 = 28, 1, 8, false;
    IQ1_M = 29, 256, 56, false;
    BF16 = 30, 1, 2, true;
    TQ1_0 = 34, 256, 54, false;
    TQ2_0 = 35, 256, 66, false;
    MXFP4 = 39, 32, 17, false;
    NVFP4 = 40, 64, 36, false;
    Q1_0 = 41, 128, 18, false;
}

/// The name of an id ggml assigned but no GGUF file holds any more: types removed from
/// ggml (`Q4_2`, `Q4_3`, the repacked `Q4_0_4_4` ...) and `Q8_1`, an intermediate of
/// ggml's dot products that is never stored.
pub fn retired_name(id: u32) -> Option<&'static str> {
    Some(match id {
        4 => "Q4_2",
        5 => "Q4_3",
        9 => "Q8_1",
        31 => "Q4_0_4_4",
        32 => "Q4_0_4_8",
        33 => "Q4_0_8_8",
        36 => "IQ4_NL_4_4",
        37 => "IQ4_NL_4_8",
        38 => "IQ4_NL_8_8",
        _ => return None,
    })
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

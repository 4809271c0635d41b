//! Element formats: what one KV element or one weight costs in bytes.
//!
//! Weight formats include the quantized ones, whose cost is not a whole
//! number of bytes: each carries its bits per weight *including* its scales
//! and zero points, as an integer count of bits per 256 weights, so the
//! arithmetic stays exact and integral.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::MemError;

/// A dense element type: activations, unquantized weights, KV cache entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// 8-bit float (e4m3 or e5m2; the same size).
    Fp8,
}

impl Dtype {
    /// Bytes per element.
    pub const fn bytes(self) -> u64 {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::Fp8 => 1,
        }
    }

    /// The canonical spelling.
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::Fp8 => "fp8",
        }
    }

    /// Parses a dtype as configs and command lines spell it
    /// (`bfloat16`, `bf16`, `float16`, `half`, `fp8_e4m3`, ...). `field`
    /// names the input in the error.
    pub fn parse(text: &str, field: &str) -> Result<Dtype, MemError> {
        match text.trim().to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" | "float" => Ok(Dtype::F32),
            "f16" | "fp16" | "float16" | "half" => Ok(Dtype::F16),
            "bf16" | "bfloat16" => Ok(Dtype::Bf16),
            "fp8" | "f8" | "fp8_e4m3" | "fp8_e5m2" | "float8_e4m3fn" | "float8_e5m2" | "e4m3"
            | "e5m2" => Ok(Dtype::Fp8),
            other => Err(MemError::invalid(format!(
                "{field}: unknown dtype '{other}'; expected one of f32, f16, bf16, fp8 \
                 (or float32, float16, bfloat16, fp8_e4m3, fp8_e5m2)"
            ))),
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Dtype {
    type Err = MemError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Dtype::parse(s, "dtype")
    }
}

/// How weights are stored, quantized formats included.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightFormat {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// 8-bit float, block scales negligible (DeepSeek-V3 style 128x128).
    Fp8,
    /// 8-bit integer, one f16 scale and an 8-bit zero per 128 weights (GPTQ/AWQ).
    Int8,
    /// 4-bit integer, one f16 scale and a 4-bit zero per 128 weights (GPTQ/AWQ).
    Int4,
    /// bitsandbytes NF4: 4 bits plus an f32 absmax per 64 weights.
    Nf4,
    /// NVFP4: 4 bits plus an fp8 scale per 16 weights.
    Nvfp4,
    /// MXFP4 (OCP microscaling): 4 bits plus an 8-bit scale per 32 weights.
    Mxfp4,
    /// GGUF Q8_0: 8.5 bits per weight.
    Q8_0,
    /// GGUF Q6_K: 6.5625 bits per weight.
    Q6K,
    /// GGUF Q5_K: 5.5 bits per weight.
    Q5K,
    /// GGUF Q4_K: 4.5 bits per weight.
    Q4K,
    /// GGUF Q4_0: 4.5 bits per weight.
    Q4_0,
}

impl WeightFormat {
    /// Every format, in declaration order.
    pub const ALL: [WeightFormat; 14] = [
        WeightFormat::F32,
        WeightFormat::F16,
        WeightFormat::Bf16,
        WeightFormat::Fp8,
        WeightFormat::Int8,
        WeightFormat::Int4,
        WeightFormat::Nf4,
        WeightFormat::Nvfp4,
        WeightFormat::Mxfp4,
        WeightFormat::Q8_0,
        WeightFormat::Q6K,
        WeightFormat::Q5K,
        WeightFormat::Q4K,
        WeightFormat::Q4_0,
    ];

    /// Bits per 256 weights, scales and zero points included.
    pub const fn bits_per_256(self) -> u64 {
        match self {
            WeightFormat::F32 => 32 * 256,
            WeightFormat::F16 | WeightFormat::Bf16 => 16 * 256,
            WeightFormat::Fp8 => 8 * 256,
            // 8 + (16 + 8) / 128 bits
            WeightFormat::Int8 => 8 * 256 + 48,
            // 4 + (16 + 4) / 128 bits
            WeightFormat::Int4 => 4 * 256 + 40,
            // 4 + 32 / 64 bits
            WeightFormat::Nf4 => 4 * 256 + 128,
            // 4 + 8 / 16 bits
            WeightFormat::Nvfp4 => 4 * 256 + 128,
            // 4 + 8 / 32 bits
            WeightFormat::Mxfp4 => 4 * 256 + 64,
            WeightFormat::Q8_0 => 2176,
            WeightFormat::Q6K => 1680,
            WeightFormat::Q5K => 1408,
            WeightFormat::Q4K | WeightFormat::Q4_0 => 1152,
        }
    }

    /// Bytes for `params` weights in this format, rounded up.
    pub const fn bytes_for(self, params: u64) -> u64 {
        let bits = params.saturating_mul(self.bits_per_256());
        bits.div_ceil(8 * 256)
    }

    /// The canonical spelling.
    pub const fn name(self) -> &'static str {
        match self {
            WeightFormat::F32 => "f32",
            WeightFormat::F16 => "f16",
            WeightFormat::Bf16 => "bf16",
            WeightFormat::Fp8 => "fp8",
            WeightFormat::Int8 => "int8",
            WeightFormat::Int4 => "int4",
            WeightFormat::Nf4 => "nf4",
            WeightFormat::Nvfp4 => "nvfp4",
            WeightFormat::Mxfp4 => "mxfp4",
            WeightFormat::Q8_0 => "q8_0",
            WeightFormat::Q6K => "q6k",
            WeightFormat::Q5K => "q5k",
            WeightFormat::Q4K => "q4k",
            WeightFormat::Q4_0 => "q4_0",
        }
    }

    /// The unquantized format of a dense dtype.
    pub const fn from_dtype(dtype: Dtype) -> WeightFormat {
        match dtype {
            Dtype::F32 => WeightFormat::F32,
            Dtype::F16 => WeightFormat::F16,
            Dtype::Bf16 => WeightFormat::Bf16,
            Dtype::Fp8 => WeightFormat::Fp8,
        }
    }

    /// Parses a weight format; `field` names the input in the error.
    pub fn parse(text: &str, field: &str) -> Result<WeightFormat, MemError> {
        let lowered = text.trim().to_ascii_lowercase().replace('-', "_");
        if let Ok(dtype) = Dtype::parse(&lowered, field) {
            return Ok(WeightFormat::from_dtype(dtype));
        }
        match lowered.as_str() {
            "int8" | "w8a16" | "w8a8" => Ok(WeightFormat::Int8),
            "int4" | "w4a16" | "gptq" | "awq" => Ok(WeightFormat::Int4),
            "nf4" => Ok(WeightFormat::Nf4),
            "nvfp4" => Ok(WeightFormat::Nvfp4),
            "mxfp4" => Ok(WeightFormat::Mxfp4),
            "q8_0" => Ok(WeightFormat::Q8_0),
            "q6_k" | "q6k" => Ok(WeightFormat::Q6K),
            "q5_k" | "q5k" | "q5_k_m" => Ok(WeightFormat::Q5K),
            "q4_k" | "q4k" | "q4_k_m" => Ok(WeightFormat::Q4K),
            "q4_0" => Ok(WeightFormat::Q4_0),
            other => Err(MemError::invalid(format!(
                "{field}: unknown weight format '{other}'; expected one of {}",
                WeightFormat::ALL.map(WeightFormat::name).join(", ")
            ))),
        }
    }
}

impl fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_sizes_and_aliases() {
        assert_eq!(Dtype::parse("bfloat16", "x").unwrap(), Dtype::Bf16);
        assert_eq!(Dtype::parse("FP8_E4M3", "x").unwrap(), Dtype::Fp8);
        assert_eq!(Dtype::Fp8.bytes(), 1);
        assert_eq!(Dtype::F32.bytes(), 4);
        let err = Dtype::parse("fp7", "kv_dtype").unwrap_err().to_string();
        assert!(err.contains("kv_dtype") && err.contains("fp7"), "{err}");
    }

    #[test]
    fn quantized_formats_cost_what_their_scales_say() {
        // 256 weights of NVFP4: 4 bits each plus 16 fp8 scales = 1152 bits = 144 bytes.
        assert_eq!(WeightFormat::Nvfp4.bytes_for(256), 144);
        // MXFP4: 4 bits plus one 8-bit scale per 32 weights = 136 bytes per 256.
        assert_eq!(WeightFormat::Mxfp4.bytes_for(256), 136);
        assert_eq!(WeightFormat::Bf16.bytes_for(1000), 2000);
        assert_eq!(WeightFormat::Q8_0.bytes_for(32), 34);
        assert_eq!(
            WeightFormat::parse("Q4_K_M", "w").unwrap(),
            WeightFormat::Q4K
        );
        assert_eq!(
            WeightFormat::parse("bfloat16", "w").unwrap(),
            WeightFormat::Bf16
        );
        assert!(WeightFormat::parse("int3", "weight_format")
            .unwrap_err()
            .to_string()
            .contains("weight_format"));
    }
}

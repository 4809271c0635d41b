//! Real weight sizes from a checkpoint's safetensors files: the index's
//! `metadata.total_size`, or the tensors in each file's header, which
//! replace the shape's estimate when present.

use std::path::Path;

use serde_json::Value;

use crate::error::MemError;

/// The real weight bytes of a checkpoint directory: the index's
/// `metadata.total_size` if `model.safetensors.index.json` exists, else the
/// sum of the tensors in every `*.safetensors` header; `None` if neither.
pub fn safetensors_bytes_in_dir(dir: &Path) -> Result<Option<u64>, MemError> {
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|err| {
            MemError::invalid(format!(
                "safetensors index: cannot read {}: {err}",
                index.display()
            ))
        })?;
        let value: Value = serde_json::from_str(&text).map_err(|err| {
            MemError::invalid(format!(
                "safetensors index: {} is not JSON: {err}",
                index.display()
            ))
        })?;
        return weights_bytes_from_safetensors_index(&value).map(Some);
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(None);
    };
    let mut files: Vec<_> = entries
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .filter(|p| p.extension().is_some_and(|ext| ext == "safetensors"))
        .collect();
    if files.is_empty() {
        return Ok(None);
    }
    files.sort();
    let mut total = 0u64;
    for file in files {
        total = total.saturating_add(safetensors_file_bytes(&file)?);
    }
    Ok(Some(total))
}

/// Tensor bytes of one `.safetensors` file, read from its header only.
pub fn safetensors_file_bytes(path: &Path) -> Result<u64, MemError> {
    use std::io::Read;
    let field = format!("safetensors header of {}", path.display());
    let mut file = std::fs::File::open(path)
        .map_err(|err| MemError::invalid(format!("{field}: cannot open: {err}")))?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len)
        .map_err(|err| MemError::invalid(format!("{field}: too short: {err}")))?;
    let header_len = u64::from_le_bytes(len);
    if header_len > 100 << 20 {
        return Err(MemError::invalid(format!(
            "{field}: header of {header_len} bytes is not plausible"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header)
        .map_err(|err| MemError::invalid(format!("{field}: truncated header: {err}")))?;
    weights_bytes_from_safetensors_header_json(&header, &field)
}

/// Tensor bytes described by a safetensors file's leading bytes: the 8-byte
/// little-endian header length, then the JSON header. `bytes` needs to hold
/// at least the header, not the tensors.
pub fn weights_bytes_from_safetensors_header(bytes: &[u8]) -> Result<u64, MemError> {
    let field = "safetensors header";
    let len_bytes: [u8; 8] = bytes
        .get(..8)
        .and_then(|s| s.try_into().ok())
        .ok_or_else(|| MemError::invalid(format!("{field}: shorter than 8 bytes")))?;
    let header_len = usize::try_from(u64::from_le_bytes(len_bytes))
        .map_err(|_| MemError::invalid(format!("{field}: length does not fit in memory")))?;
    let header = bytes
        .get(8..8usize.saturating_add(header_len))
        .ok_or_else(|| {
            MemError::invalid(format!("{field}: truncated (declares {header_len} bytes)"))
        })?;
    weights_bytes_from_safetensors_header_json(header, field)
}

fn weights_bytes_from_safetensors_header_json(header: &[u8], field: &str) -> Result<u64, MemError> {
    let value: Value = serde_json::from_slice(header)
        .map_err(|err| MemError::invalid(format!("{field}: not JSON: {err}")))?;
    let map = value
        .as_object()
        .ok_or_else(|| MemError::invalid(format!("{field}: expected a JSON object")))?;
    let mut total = 0u64;
    for (name, tensor) in map {
        if name == "__metadata__" {
            continue;
        }
        let offsets = tensor.get("data_offsets").and_then(Value::as_array);
        let (Some(begin), Some(end)) = (
            offsets.and_then(|o| o.first()).and_then(Value::as_u64),
            offsets.and_then(|o| o.get(1)).and_then(Value::as_u64),
        ) else {
            return Err(MemError::invalid(format!(
                "{field}: tensor '{name}' has no data_offsets"
            )));
        };
        if end < begin {
            return Err(MemError::invalid(format!(
                "{field}: tensor '{name}' ends before it begins"
            )));
        }
        total = total.saturating_add(end - begin);
    }
    Ok(total)
}

/// `metadata.total_size` of a `model.safetensors.index.json`.
pub fn weights_bytes_from_safetensors_index(index: &Value) -> Result<u64, MemError> {
    index
        .get("metadata")
        .and_then(|m| m.get("total_size"))
        .and_then(|v| {
            v.as_u64()
                .or_else(|| v.as_f64().filter(|f| *f >= 0.0).map(|f| f as u64))
        })
        .ok_or_else(|| MemError::invalid("safetensors index: missing field 'metadata.total_size'"))
}

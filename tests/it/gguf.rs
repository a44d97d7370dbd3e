//! The GGUF reader (src/model/gguf/): every block format against hand-computed values
//! and against the `gguf` Python package (random blocks, then every tensor of the two
//! pretrained models by SHA-256; tests/fixtures/pretrained/gguf-dequant.json, made by
//! scripts/reference/gguf_dequant.py), the metadata reads, one test per hostile header,
//! and a seeded mutation fuzz of a small valid file.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

use phaselens::Error;
use phaselens::model::gguf::{GgmlType, GgufFile, MetaValue, dequantize};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sha2::{Digest, Sha256};

use crate::common::pretrained::{GEMMA3, SMOLLM2, model_file};

// ------------------------------------------------------------------- a tiny writer

/// A GGUF file written byte by byte (version 3, alignment 32 unless set): metadata in
/// the order added, tensors packed in the data section at aligned offsets.
struct Gguf {
    magic: [u8; 4],
    version: u32,
    n_kv: u64,
    kv: Vec<u8>,
    n_tensors: u64,
    infos: Vec<u8>,
    data: Vec<u8>,
    alignment: usize,
}

fn gstr(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

impl Gguf {
    fn new() -> Gguf {
        Gguf {
            magic: *b"GGUF",
            version: 3,
            n_kv: 0,
            kv: vec![],
            n_tensors: 0,
            infos: vec![],
            data: vec![],
            alignment: 32,
        }
    }

    /// A key with value type `ty` and the value's bytes as given.
    fn kv_raw(mut self, key: &str, ty: u32, value: &[u8]) -> Gguf {
        gstr(&mut self.kv, key);
        self.kv.extend(ty.to_le_bytes());
        self.kv.extend(value);
        self.n_kv += 1;
        self
    }

    fn kv_u32(self, key: &str, v: u32) -> Gguf {
        self.kv_raw(key, 4, &v.to_le_bytes())
    }

    fn kv_str(self, key: &str, v: &str) -> Gguf {
        let mut b = vec![];
        gstr(&mut b, v);
        self.kv_raw(key, 8, &b)
    }

    /// An array of `n` elements of type `ty` whose bytes are `elems`.
    fn kv_array(self, key: &str, ty: u32, n: u64, elems: &[u8]) -> Gguf {
        let mut b = ty.to_le_bytes().to_vec();
        b.extend(n.to_le_bytes());
        b.extend(elems);
        self.kv_raw(key, 9, &b)
    }

    fn kv_strs(self, key: &str, v: &[&str]) -> Gguf {
        let mut b = vec![];
        for s in v {
            gstr(&mut b, s);
        }
        self.kv_array(key, 8, v.len() as u64, &b)
    }

    /// A directory entry as given (type id, offset), no data.
    fn info(mut self, name: &str, dims: &[u64], type_id: u32, offset: u64) -> Gguf {
        gstr(&mut self.infos, name);
        self.infos.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            self.infos.extend(d.to_le_bytes());
        }
        self.infos.extend(type_id.to_le_bytes());
        self.infos.extend(offset.to_le_bytes());
        self.n_tensors += 1;
        self
    }

    /// A tensor and its bytes at the next aligned offset.
    fn tensor(mut self, name: &str, dims: &[u64], t: GgmlType, bytes: &[u8]) -> Gguf {
        let off = self.data.len().next_multiple_of(self.alignment);
        self.data.resize(off, 0);
        self.data.extend(bytes);
        self.info(name, dims, t.id(), off as u64)
    }

    fn bytes(&self) -> Vec<u8> {
        let mut b = self.magic.to_vec();
        b.extend(self.version.to_le_bytes());
        b.extend(self.n_tensors.to_le_bytes());
        b.extend(self.n_kv.to_le_bytes());
        b.extend(&self.kv);
        b.extend(&self.infos);
        b.resize(b.len().next_multiple_of(self.alignment), 0);
        b.extend(&self.data);
        b
    }
}

/// A small valid file: one key of every scalar type, arrays, and three tensors (F32,
/// Q4_0, Q8_0) with known values.
fn sample() -> Gguf {
    let q4 = q4_0_block();
    let q8 = q8_0_block();
    Gguf::new()
        .kv_str("general.architecture", "llama")
        .kv_u32("llama.block_count", 2)
        .kv_raw("u8", 0, &[7])
        .kv_raw("i8", 1, &[0xFE])
        .kv_raw("u16", 2, &300u16.to_le_bytes())
        .kv_raw("i16", 3, &(-300i16).to_le_bytes())
        .kv_raw("i32", 5, &(-5i32).to_le_bytes())
        .kv_raw("i32 positive", 5, &12i32.to_le_bytes())
        .kv_raw("f32", 6, &1.5f32.to_le_bytes())
        .kv_raw("bool", 7, &[1])
        .kv_raw("u64", 10, &(1u64 << 40).to_le_bytes())
        .kv_raw("i64", 11, &(-1i64).to_le_bytes())
        .kv_raw("f64", 12, &0.25f64.to_le_bytes())
        .kv_strs("tokens", &["a", "bc", "<0x0A>"])
        .kv_array(
            "scores",
            6,
            2,
            &[1f32.to_le_bytes(), (-2f32).to_le_bytes()].concat(),
        )
        .kv_array(
            "token_type",
            5,
            2,
            &[1i32.to_le_bytes(), 3i32.to_le_bytes()].concat(),
        )
        .tensor(
            "norm",
            &[3],
            GgmlType::F32,
            &[1f32, 2., 3.].map(f32::to_le_bytes).concat(),
        )
        .tensor("q4", &[32, 2], GgmlType::Q4_0, &[q4.clone(), q4].concat())
        .tensor("q8", &[32], GgmlType::Q8_0, &q8)
}

/// Write `bytes` to a fresh file (kept alive by the returned guard) and open it.
fn open_bytes(bytes: &[u8]) -> (tempfile::TempDir, phaselens::Result<GgufFile>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.gguf");
    std::fs::write(&path, bytes).unwrap();
    let r = GgufFile::open(&path);
    (dir, r)
}

/// Open `bytes`, expect an error whose message holds every one of `want`.
fn refused(bytes: &[u8], want: &[&str]) -> Error {
    let (_dir, r) = open_bytes(bytes);
    let e = r.expect_err("a hostile file was accepted");
    let msg = e.to_string();
    for w in want {
        assert!(msg.contains(w), "error lacks `{w}`: {msg}");
    }
    assert!(msg.contains("t.gguf"), "error lacks the file: {msg}");
    e
}

/// `e` is a tensor error naming `name`.
fn names_tensor(e: &Error, name: &str) {
    assert!(
        matches!(e, Error::Tensor { tensor, .. } if tensor == name),
        "expected a tensor error naming `{name}`: {e:?}"
    );
}

fn is_config(e: &Error) {
    assert!(
        matches!(e, Error::Config { .. }),
        "expected a header (config) error: {e:?}"
    );
}

// ----------------------------------------------------- blocks, hand-computed

fn h(x: f32) -> [u8; 2] {
    half::f16::from_f32(x).to_le_bytes()
}

fn dq(t: GgmlType, bytes: &[u8], n: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; n];
    dequantize(t, bytes, &mut out).unwrap();
    out
}

/// `got` equals `want(i)` at every index, bit for bit.
fn check(got: &[f32], want: impl Fn(usize) -> f32) {
    for (i, &g) in got.iter().enumerate() {
        assert_eq!(
            g.to_bits(),
            want(i).to_bits(),
            "value {i}: {g} vs {}",
            want(i)
        );
    }
}

/// Q4_0, d = 0.5: qs[j] = j | (15 - j) << 4.
fn q4_0_block() -> Vec<u8> {
    let mut b = h(0.5).to_vec();
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    b
}

/// Q8_0, d = 0.25: qs[j] = j - 16.
fn q8_0_block() -> Vec<u8> {
    let mut b = h(0.25).to_vec();
    b.extend((0..32).map(|j: i32| (j - 16) as i8 as u8));
    b
}

#[test]
fn plain_floats_decode_as_stored() {
    let f32s = [1.5f32, -0.0, f32::INFINITY, 3e-39];
    check(
        &dq(GgmlType::F32, &f32s.map(f32::to_le_bytes).concat(), 4),
        |i| f32s[i],
    );
    let f16s = [h(1.0), h(-2.5), h(65504.0), [0x01, 0x00]].concat();
    check(&dq(GgmlType::F16, &f16s, 4), |i| {
        [1.0, -2.5, 65504.0, 2f32.powi(-24)][i]
    });
    // bf16 0x3FC0 = 1.5, 0xC100 = -8, 0x0001 = the smallest subnormal of f32's exponent
    let bf16s = [0x3FC0u16, 0xC100, 0x0001].map(u16::to_le_bytes).concat();
    check(&dq(GgmlType::BF16, &bf16s, 3), |i| {
        [1.5, -8.0, f32::from_bits(0x0001_0000)][i]
    });
}

#[test]
fn q4_0_is_nibble_minus_8_times_d() {
    let y = dq(GgmlType::Q4_0, &q4_0_block(), 32);
    assert_eq!((y[0], y[15], y[16], y[31]), (-4.0, 3.5, 3.5, -4.0));
    check(&y, |i| {
        if i < 16 {
            (i as f32 - 8.0) * 0.5
        } else {
            (7.0 - (i - 16) as f32) * 0.5
        }
    });
}

#[test]
fn q4_1_is_nibble_times_d_plus_m() {
    let mut b = [h(0.5), h(-1.0)].concat();
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let y = dq(GgmlType::Q4_1, &b, 32);
    assert_eq!((y[0], y[15], y[16], y[31]), (-1.0, 6.5, 6.5, -1.0));
    check(&y, |i| {
        if i < 16 {
            i as f32 * 0.5 - 1.0
        } else {
            (31 - i) as f32 * 0.5 - 1.0
        }
    });
}

#[test]
fn q5_0_takes_the_fifth_bit_from_qh() {
    // qh: the fifth bit set for values 16..32 only
    let mut b = h(1.0).to_vec();
    b.extend(0xFFFF_0000u32.to_le_bytes());
    b.extend((0..16u8).map(|j| j | (j << 4)));
    let y = dq(GgmlType::Q5_0, &b, 32);
    assert_eq!((y[0], y[15], y[16], y[31]), (-16.0, -1.0, 0.0, 15.0));
    check(&y, |i| i as f32 - 16.0);
}

#[test]
fn q5_1_takes_the_fifth_bit_from_qh_and_adds_m() {
    // qh: the fifth bit set for values 0..16 only
    let mut b = [h(0.5), h(2.0)].concat();
    b.extend(0x0000_FFFFu32.to_le_bytes());
    b.extend((0..16u8).map(|j| j | (j << 4)));
    let y = dq(GgmlType::Q5_1, &b, 32);
    assert_eq!((y[0], y[15], y[16], y[31]), (10.0, 17.5, 2.0, 9.5));
    check(&y, |i| {
        if i < 16 {
            (i + 16) as f32 * 0.5 + 2.0
        } else {
            (i - 16) as f32 * 0.5 + 2.0
        }
    });
}

#[test]
fn q8_0_is_signed_byte_times_d() {
    let y = dq(GgmlType::Q8_0, &q8_0_block(), 32);
    assert_eq!((y[0], y[16], y[31]), (-4.0, 0.0, 3.75));
    check(&y, |i| (i as f32 - 16.0) * 0.25);
}

#[test]
fn q2_k_scales_and_mins_per_16_values() {
    // scale of sub-block s: s % 15 + 1, min 2 (times dmin 0.5 = 1); every byte of qs
    // 0b11_10_01_00, so the quant of shift j is j
    let mut b: Vec<u8> = (0..16u8).map(|s| (s % 15 + 1) | (2 << 4)).collect();
    b.extend([0xE4u8; 64]);
    b.extend([h(1.0), h(0.5)].concat());
    let y = dq(GgmlType::Q2_K, &b, 256);
    assert_eq!((y[0], y[32], y[100], y[255]), (-1.0, 2.0, 20.0, 2.0));
    check(&y, |i| {
        let (j, s) = ((i % 128) / 32, i / 16);
        (s % 15 + 1) as f32 * j as f32 - 1.0
    });
}

#[test]
fn q3_k_subtracts_4_where_the_high_bit_is_clear() {
    // every 6-bit scale 33 (-> 1) but scale 5, 35 (-> 3): low nibbles 1 (byte 5's low 3),
    // high bits 0b10 for all; hmask bits 0..4 set (first half: no subtraction)
    let mut b = vec![0x0Fu8; 32];
    b.extend([0xE4u8; 64]);
    b.extend([
        0x11, 0x11, 0x11, 0x11, 0x11, 0x13, 0x11, 0x11, 0xAA, 0xAA, 0xAA, 0xAA,
    ]);
    b.extend(h(1.0));
    let y = dq(GgmlType::Q3_K, &b, 256);
    assert_eq!(
        (y[0], y[33], y[79], y[80], y[128], y[255]),
        (0.0, 1.0, 2.0, 6.0, -4.0, -1.0)
    );
    check(&y, |i| {
        let (half, j) = (i / 128, (i % 128) / 32);
        let sc = if i / 16 == 5 { 3.0 } else { 1.0 };
        sc * (j as f32 - if half == 1 { 4.0 } else { 0.0 })
    });
}

/// Q4_K / Q5_K scale bytes: scales [1, 2, 3, 4, 21, 6, 7, 8], mins [2, 2, 2, 2, 34, 2, 2, 2]
/// (sub-block 4's scale and min take their top bits from bytes 0 and 4).
fn k4_scales() -> [u8; 12] {
    [1 | 0x40, 2, 3, 4, 2 | 0x80, 2, 2, 2, 0x25, 0x26, 0x27, 0x28]
}
const K4_SC: [f32; 8] = [1., 2., 3., 4., 21., 6., 7., 8.];
const K4_M: [f32; 8] = [2., 2., 2., 2., 34., 2., 2., 2.];

#[test]
fn q4_k_unpacks_six_bit_scales_and_mins() {
    // d 1, dmin 0.5; every quant byte 0x53: low nibble 3, high 5
    let mut b = [h(1.0), h(0.5)].concat();
    b.extend(k4_scales());
    b.extend([0x53u8; 128]);
    let y = dq(GgmlType::Q4_K, &b, 256);
    let firsts: Vec<f32> = (0..8).map(|s| y[32 * s]).collect();
    assert_eq!(firsts, [2.0, 9.0, 8.0, 19.0, 46.0, 29.0, 20.0, 39.0]);
    check(&y, |i| {
        let s = i / 32;
        K4_SC[s] * if s % 2 == 0 { 3.0 } else { 5.0 } - 0.5 * K4_M[s]
    });
}

#[test]
fn q5_k_adds_16_where_qh_has_the_sub_blocks_bit() {
    // as Q4_K, and qh[l] = 0x81 for l < 16: bit 4 of sub-blocks 0 and 7's first 16 values
    let mut b = [h(1.0), h(0.5)].concat();
    b.extend(k4_scales());
    b.extend((0..32).map(|l| if l < 16 { 0x81u8 } else { 0 }));
    b.extend([0x53u8; 128]);
    let y = dq(GgmlType::Q5_K, &b, 256);
    assert_eq!((y[0], y[16], y[224], y[240]), (18.0, 2.0, 167.0, 39.0));
    check(&y, |i| {
        let s = i / 32;
        let high = if (s == 0 || s == 7) && i % 32 < 16 {
            16.0
        } else {
            0.0
        };
        K4_SC[s] * (if s % 2 == 0 { 3.0 } else { 5.0 } + high) - 0.5 * K4_M[s]
    });
}

#[test]
fn q6_k_combines_four_nibbles_with_two_high_bits() {
    // ql bytes 0x21 (low 1, high 2), qh bytes 0b11_10_01_00 (k-th pair = k), scales
    // s - 8, d 0.5: quants -31, -15, 2, 18 for k = 0..4
    let mut b = vec![0x21u8; 128];
    b.extend([0xE4u8; 64]);
    b.extend((0..16).map(|s: i32| (s - 8) as i8 as u8));
    b.extend(h(0.5));
    let y = dq(GgmlType::Q6_K, &b, 256);
    assert_eq!(
        (y[0], y[16], y[32], y[64], y[96], y[128], y[255]),
        (124.0, 108.5, 45.0, -4.0, -18.0, 0.0, 63.0)
    );
    check(&y, |i| {
        let q = [-31.0, -15.0, 2.0, 18.0][(i % 128) / 32];
        (0.5 * (i / 16) as f32 - 4.0) * q
    });
}

#[test]
fn q8_k_is_signed_byte_times_f32_d() {
    let mut b = 0.5f32.to_le_bytes().to_vec();
    b.extend((0..=255u8).collect::<Vec<_>>());
    b.extend([0u8; 32]);
    let y = dq(GgmlType::Q8_K, &b, 256);
    assert_eq!((y[1], y[127], y[128], y[255]), (0.5, 63.5, -64.0, -0.5));
    check(&y, |i| 0.5 * (i as u8 as i8) as f32);
}

#[test]
fn block_sizes_and_lengths_are_checked() {
    for &t in GgmlType::ALL {
        assert_eq!(GgmlType::from_id(t.id()), Some(t), "{t}");
    }
    assert_eq!(GgmlType::Q4_K.block_size(), 256);
    assert_eq!(GgmlType::Q6_K.type_size(), 210);
    assert_eq!(GgmlType::Q4_1.name(), "Q4_1");
    let mut out = vec![0f32; 33];
    let e = dequantize(GgmlType::Q8_0, &[0; 34], &mut out).unwrap_err();
    assert!(
        e.to_string().contains("not a multiple of its block of 32"),
        "{e}"
    );
    let mut out = vec![0f32; 32];
    let e = dequantize(GgmlType::Q8_0, &[0; 33], &mut out).unwrap_err();
    assert!(e.to_string().contains("33 bytes"), "{e}");
    let e = dequantize(GgmlType::IQ2_XXS, &[0; 66], &mut [0f32; 256]).unwrap_err();
    assert!(e.to_string().contains("IQ2_XXS"), "{e}");
}

// ------------------------------------------------ against the Python package

fn fixture() -> serde_json::Value {
    let p =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/pretrained/gguf-dequant.json");
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

fn sha256_f32(v: &[f32]) -> String {
    let mut h = Sha256::new();
    for chunk in v.chunks(1 << 16) {
        let bytes: Vec<u8> = chunk.iter().flat_map(|x| x.to_le_bytes()).collect();
        h.update(&bytes);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn type_named(name: &str) -> GgmlType {
    *GgmlType::ALL.iter().find(|t| t.name() == name).unwrap()
}

/// The first values `first` of the fixture equal `got`'s, bit for bit.
fn same_first(what: &str, got: &[f32], first: &serde_json::Value) {
    for (i, w) in first.as_array().unwrap().iter().enumerate() {
        let w = w.as_f64().unwrap() as f32;
        assert_eq!(
            got[i].to_bits(),
            w.to_bits(),
            "{what}: value {i}: {} vs {w}",
            got[i]
        );
    }
}

#[test]
fn random_blocks_of_every_format_match_the_python_package() {
    let fx = fixture();
    let blocks = fx["blocks"].as_array().unwrap();
    assert!(
        blocks.len() >= 12,
        "the fixture has {} block types",
        blocks.len()
    );
    for b in blocks {
        let t = type_named(b["type"].as_str().unwrap());
        let bytes = unhex(b["bytes"].as_str().unwrap());
        let n = bytes.len() / t.type_size() * t.block_size();
        let y = dq(t, &bytes, n);
        same_first(t.name(), &y, &b["first"]);
        assert_eq!(sha256_f32(&y), b["sha256"].as_str().unwrap(), "{t}");
    }
}

/// Every tensor of model `key` dequantises to the fixture's digest (and prints the time
/// the dequantisation took).
fn model_matches(key: &str, rel: &str) {
    let Some(path) = model_file(rel) else { return };
    let fx = &fixture()["models"][key];
    let f = GgufFile::open(&path).unwrap();
    let want = fx["tensors"].as_array().unwrap();
    assert_eq!(f.tensors().len(), want.len());
    let mut seconds = 0.0;
    let mut bad = vec![];
    for (t, w) in f.tensors().iter().zip(want) {
        assert_eq!(t.name, w["name"].as_str().unwrap());
        assert_eq!(
            t.ggml_type.name(),
            w["type"].as_str().unwrap(),
            "{}",
            t.name
        );
        let shape: Vec<usize> = serde_json::from_value(w["shape"].clone()).unwrap();
        assert_eq!(t.shape(), shape, "{}", t.name);
        let start = std::time::Instant::now();
        let y = f.dequantize(&t.name).unwrap();
        seconds += start.elapsed().as_secs_f64();
        assert_eq!(y.len(), t.n_elements());
        same_first(&t.name, &y, &w["first"]);
        if sha256_f32(&y) != w["sha256"].as_str().unwrap() {
            bad.push(format!("{} ({})", t.name, t.ggml_type));
        }
    }
    eprintln!(
        "{key}: {} tensors dequantised in {seconds:.2} s",
        want.len()
    );
    assert!(
        bad.is_empty(),
        "{key}: {} tensors differ: {bad:?}",
        bad.len()
    );
}

#[test]
fn smollm2_tensors_dequantise_bit_identically_to_the_python_package() {
    model_matches("smollm2", SMOLLM2);
}

#[test]
fn gemma3_tensors_dequantise_bit_identically_to_the_python_package() {
    model_matches("gemma3", GEMMA3);
}

fn metadata_matches(key: &str, rel: &str) -> Option<GgufFile> {
    let path = model_file(rel)?;
    let fx = &fixture()["models"][key]["metadata"];
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.version(), 3);
    let arch = f.architecture().unwrap().to_string();
    assert_eq!(arch, fx["general.architecture"].as_str().unwrap());
    for k in [
        "block_count",
        "attention.head_count",
        "attention.head_count_kv",
        "embedding_length",
        "context_length",
    ] {
        let k = format!("{arch}.{k}");
        assert_eq!(f.uint(&k).unwrap(), fx[k.as_str()].as_u64().unwrap(), "{k}");
    }
    let tokens = f.strings("tokenizer.ggml.tokens").unwrap();
    assert_eq!(
        f.ints("tokenizer.ggml.token_type").unwrap().len(),
        tokens.len()
    );
    Some(f)
}

#[test]
fn smollm2_metadata_reads_as_its_config() {
    let Some(f) = metadata_matches("smollm2", SMOLLM2) else {
        return;
    };
    assert_eq!(
        (
            f.uint("llama.block_count").unwrap(),
            f.uint("llama.attention.head_count").unwrap()
        ),
        (30, 9)
    );
    assert_eq!(f.strings("tokenizer.ggml.tokens").unwrap().len(), 49152);
    assert_eq!(f.strings("tokenizer.ggml.merges").unwrap().len(), 48900);
    assert_eq!(f.float("llama.rope.freq_base").unwrap(), 100000.0);
    assert_eq!(f.opt_uint("llama.no_such_key").unwrap(), None);
    assert_eq!(
        f.get("tokenizer.ggml.add_bos_token"),
        Some(&MetaValue::Bool(false))
    );
}

#[test]
fn gemma3_metadata_reads_as_its_config() {
    let Some(f) = metadata_matches("gemma3", GEMMA3) else {
        return;
    };
    assert_eq!(f.uint("gemma3.attention.head_count_kv").unwrap(), 1);
    let n = f.strings("tokenizer.ggml.tokens").unwrap().len();
    assert_eq!(f.floats("tokenizer.ggml.scores").unwrap().len(), n);
}

#[test]
fn rows_of_the_embedding_equal_the_same_rows_of_the_whole_tensor() {
    for rel in [SMOLLM2, GEMMA3] {
        let Some(path) = model_file(rel) else {
            continue;
        };
        let f = GgufFile::open(&path).unwrap();
        let t = f.tensor("token_embd.weight").unwrap();
        let d = t.shape()[1];
        let all = f.dequantize("token_embd.weight").unwrap();
        let rows = f.dequantize_rows("token_embd.weight", 1000..1003).unwrap();
        assert_eq!(rows, all[1000 * d..1003 * d], "{rel} ({})", t.ggml_type);
        let n = t.shape()[0];
        assert!(
            f.dequantize_rows("token_embd.weight", n - 1..n + 1)
                .is_err()
        );
    }
}

// ---------------------------------------------------------- the small sample

#[test]
fn a_written_file_reads_back_every_value_type() {
    let (_d, r) = open_bytes(&sample().bytes());
    let f = r.unwrap();
    assert_eq!(
        (
            f.version(),
            f.alignment(),
            f.metadata().len(),
            f.tensors().len()
        ),
        (3, 32, 16, 3)
    );
    assert_eq!(f.architecture().unwrap(), "llama");
    assert_eq!(f.uint("u8").unwrap(), 7);
    assert_eq!(f.uint("u64").unwrap(), 1 << 40);
    assert_eq!(f.uint("i32 positive").unwrap(), 12);
    assert_eq!(f.float("f32").unwrap(), 1.5);
    assert_eq!(f.float("u16").unwrap(), 300.0);
    assert_eq!(f.opt_float("f64").unwrap(), Some(0.25));
    assert_eq!(f.get("i8"), Some(&MetaValue::I8(-2)));
    assert_eq!(f.get("i16"), Some(&MetaValue::I16(-300)));
    assert_eq!(f.get("i64"), Some(&MetaValue::I64(-1)));
    assert_eq!(f.get("bool"), Some(&MetaValue::Bool(true)));
    assert_eq!(f.strings("tokens").unwrap(), ["a", "bc", "<0x0A>"]);
    assert_eq!(f.floats("scores").unwrap(), [1.0, -2.0]);
    assert_eq!(f.ints("token_type").unwrap(), [1, 3]);
    assert_eq!(f.dequantize("norm").unwrap(), [1.0, 2.0, 3.0]);
    let q4 = f.tensor("q4").unwrap();
    assert_eq!(
        (q4.shape(), q4.n_elements(), q4.n_bytes()),
        (vec![2, 32], 64, 36)
    );
    assert_eq!(f.raw(q4).len(), 36);
    let one = dq(GgmlType::Q4_0, &q4_0_block(), 32);
    assert_eq!(
        f.dequantize("q4").unwrap(),
        [one.clone(), one.clone()].concat()
    );
    assert_eq!(f.dequantize_rows("q4", 1..2).unwrap(), one);
    assert_eq!(f.dequantize_rows("q4", 2..2).unwrap(), Vec::<f32>::new());
    assert_eq!(
        f.dequantize("q8").unwrap(),
        dq(GgmlType::Q8_0, &q8_0_block(), 32)
    );
}

#[test]
fn mistyped_or_missing_metadata_names_the_key_and_the_type_found() {
    let (_d, r) = open_bytes(&sample().bytes());
    let f = r.unwrap();
    let msg = |e: Error| e.to_string();
    let m = msg(f.str("llama.block_count").unwrap_err());
    assert!(
        m.contains("t.gguf") && m.contains("`llama.block_count`") && m.contains("uint32"),
        "{m}"
    );
    let m = msg(f.uint("i32").unwrap_err());
    assert!(m.contains("`i32`") && m.contains("int32 -5"), "{m}");
    let m = msg(f.uint("nope").unwrap_err());
    assert!(m.contains("`nope`") && m.contains("missing"), "{m}");
    let m = msg(f.opt_uint("general.architecture").unwrap_err());
    assert!(m.contains("string"), "{m}");
    let m = msg(f.strings("scores").unwrap_err());
    assert!(
        m.contains("`scores`") && m.contains("array of 2 float32"),
        "{m}"
    );
    let m = msg(f.floats("tokens").unwrap_err());
    assert!(m.contains("array of 3 string"), "{m}");
    assert!(f.ints("scores").is_err() && f.float("tokens").is_err());
    let e = f.tensor("nope").unwrap_err();
    names_tensor(&e, "nope");
}

// ------------------------------------------------------------ hostile headers

#[test]
fn every_truncation_of_a_valid_file_is_an_error() {
    let full = sample().bytes();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.gguf");
    for len in 0..full.len() {
        std::fs::write(&path, &full[..len]).unwrap();
        let r = GgufFile::open(&path);
        assert!(
            r.is_err(),
            "accepted the first {len} of {} bytes",
            full.len()
        );
    }
    let one = Gguf::new().kv_u32("llama.block_count", 2).bytes();
    // 24 header bytes, the key (8 + 17), its type (4): the value's 4 bytes start at 53
    let e = refused(
        &one[..55],
        &["`llama.block_count`", "needs 4 bytes", "at byte 53"],
    );
    is_config(&e);
}

#[test]
fn wrong_magic_is_refused() {
    let mut g = sample();
    g.magic = *b"GGML";
    is_config(&refused(&g.bytes(), &["not a GGUF file", "magic"]));
}

#[test]
fn versions_other_than_2_and_3_are_refused() {
    for v in [0, 1, 4, u32::MAX] {
        let mut g = sample();
        g.version = v;
        refused(&g.bytes(), &[&format!("version {v}")]);
    }
    let mut g = sample();
    g.version = 2;
    assert!(open_bytes(&g.bytes()).1.is_ok());
    let mut g = sample();
    g.version = 3u32.swap_bytes();
    refused(&g.bytes(), &["big-endian"]);
}

#[test]
fn metadata_and_tensor_counts_beyond_the_file_are_refused_before_allocating() {
    for n in [u64::MAX, 1 << 40, 1000] {
        let mut g = sample();
        g.n_kv = n;
        is_config(&refused(&g.bytes(), &["metadata count", &n.to_string()]));
        let mut g = sample();
        g.n_tensors = n;
        refused(&g.bytes(), &["tensor count"]);
    }
}

#[test]
fn string_lengths_beyond_the_file_are_refused() {
    let huge = u64::MAX.to_le_bytes();
    // a key whose length is huge
    let mut g = Gguf::new();
    g.kv.extend(huge);
    g.kv.extend([0; 16]); // room for one key/value, so the count passes
    g.n_kv = 1;
    refused(&g.bytes(), &["metadata key 0", "string length"]);
    // a string value whose length is huge
    let g = Gguf::new().kv_raw("general.name", 8, &huge);
    refused(&g.bytes(), &["`general.name`", "string length"]);
}

#[test]
fn array_lengths_beyond_the_file_are_refused() {
    let g = Gguf::new().kv_array("tokenizer.ggml.tokens", 8, 1 << 60, &[]);
    refused(&g.bytes(), &["`tokenizer.ggml.tokens`", "array length"]);
    let g = Gguf::new().kv_array("u8s", 0, 1000, &[1; 99]);
    refused(&g.bytes(), &["`u8s`", "array length 1000"]);
}

#[test]
fn unknown_value_types_are_refused() {
    refused(
        &Gguf::new().kv_raw("k", 13, &[0; 8]).bytes(),
        &["`k`", "unknown value type 13"],
    );
    let g = Gguf::new().kv_array("a", 99, 1, &[0; 8]);
    refused(&g.bytes(), &["`a`", "unknown array element type 99"]);
    let g = Gguf::new().kv_array("nested", 9, 1, &[0; 12]);
    refused(&g.bytes(), &["`nested`", "arrays of arrays"]);
    refused(
        &Gguf::new().kv_raw("flag", 7, &[2]).bytes(),
        &["`flag`", "bool 2"],
    );
    let g = Gguf::new().kv_raw("s", 8, &[2, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFE]);
    refused(&g.bytes(), &["`s`", "not UTF-8"]);
}

#[test]
fn duplicate_keys_are_refused() {
    let g = sample().kv_u32("llama.block_count", 3);
    refused(&g.bytes(), &["`llama.block_count`", "repeats"]);
}

#[test]
fn an_alignment_that_is_not_a_power_of_two_is_refused() {
    let g = sample().kv_u32("general.alignment", 24);
    refused(&g.bytes(), &["`general.alignment`", "power of two"]);
    let g = sample().kv_str("general.alignment", "32");
    refused(&g.bytes(), &["`general.alignment`", "string"]);
    let mut g = Gguf::new();
    g.alignment = 64;
    let g = g
        .kv_u32("general.alignment", 64)
        .tensor("a", &[1], GgmlType::F32, &[0; 4])
        .tensor("b", &[32], GgmlType::Q8_0, &q8_0_block());
    let (_d, r) = open_bytes(&g.bytes());
    let f = r.unwrap();
    assert_eq!((f.alignment(), f.tensor("b").unwrap().offset), (64, 64));
    assert_eq!(
        f.dequantize("b").unwrap(),
        dq(GgmlType::Q8_0, &q8_0_block(), 32)
    );
}

#[test]
fn dims_overflowing_usize_are_refused() {
    let g = sample().info("huge", &[u64::MAX, 4], 0, 0);
    names_tensor(&refused(&g.bytes(), &["usize"]), "huge");
    let g = sample().info("huge2", &[1 << 32, 1 << 32, 1 << 32], 0, 0);
    names_tensor(&refused(&g.bytes(), &["usize"]), "huge2");
}

#[test]
fn more_than_four_dims_are_refused() {
    let g = sample().info("five", &[1, 1, 1, 1, 1], 0, 0);
    names_tensor(&refused(&g.bytes(), &["5 dims", "at most 4"]), "five");
}

#[test]
fn unaligned_offsets_are_refused() {
    let g = sample().info("odd", &[1], 0, 4);
    names_tensor(&refused(&g.bytes(), &["offset 4", "alignment 32"]), "odd");
}

#[test]
fn offsets_beyond_the_file_are_refused() {
    let g = sample().info("far", &[8], 0, 1 << 40);
    names_tensor(&refused(&g.bytes(), &["past the file's end"]), "far");
    let g = sample().info("wrap", &[8], 0, u64::MAX - 31);
    names_tensor(&refused(&g.bytes(), &["overflow"]), "wrap");
}

#[test]
fn a_tensor_overlapping_the_end_of_the_file_is_refused() {
    let mut bytes = sample().bytes();
    bytes.truncate(bytes.len() - 1);
    names_tensor(
        &refused(&bytes, &["34 bytes of Q8_0", "past the file's end"]),
        "q8",
    );
}

#[test]
fn tensors_sharing_bytes_are_refused() {
    let g = sample().info("alias", &[3], 0, 0);
    names_tensor(&refused(&g.bytes(), &["overlaps tensor `"]), "alias");
}

#[test]
fn duplicate_tensor_names_are_refused() {
    let g = sample().tensor("norm", &[1], GgmlType::F32, &[0; 4]);
    names_tensor(&refused(&g.bytes(), &["repeats the name"]), "norm");
}

#[test]
fn rows_that_do_not_split_into_blocks_are_refused() {
    let g = sample().tensor("ragged", &[16], GgmlType::Q4_0, &[0; 18]);
    names_tensor(&refused(&g.bytes(), &["Q4_0", "blocks of 32"]), "ragged");
}

#[test]
fn unknown_and_retired_types_are_refused_with_their_id_and_name() {
    let g = sample().info("new", &[32], 99, 0);
    names_tensor(&refused(&g.bytes(), &["ggml type 99", "unknown"]), "new");
    let g = sample().info("old", &[32], 4, 0);
    names_tensor(&refused(&g.bytes(), &["ggml type 4", "Q4_2"]), "old");
}

#[test]
fn a_type_without_a_decoder_opens_but_does_not_dequantise() {
    let g = sample().tensor("iq", &[256], GgmlType::IQ2_XXS, &[0; 66]);
    let (_d, r) = open_bytes(&g.bytes());
    let f = r.unwrap();
    assert_eq!(f.raw(f.tensor("iq").unwrap()).len(), 66);
    let e = f.dequantize("iq").unwrap_err();
    names_tensor(&e, "iq");
    assert!(
        e.to_string().contains("IQ2_XXS") && e.to_string().contains("16"),
        "{e}"
    );
}

// --------------------------------------------------------------------- fuzz

/// Mutate `v` once: flip bytes, truncate, or write a huge or random number over an
/// 8-byte window (counts, lengths, dims, offsets).
fn mutate(v: &mut Vec<u8>, rng: &mut ChaCha8Rng) {
    for _ in 0..rng.random_range(1..4) {
        if v.is_empty() {
            return;
        }
        let i = rng.random_range(0..v.len());
        match rng.random_range(0..4) {
            0 => v[i] ^= 1 << rng.random_range(0..8),
            1 => v[i] = rng.random(),
            2 => v.truncate(i),
            _ => {
                let x: u64 = match rng.random_range(0..4) {
                    0 => u64::MAX,
                    1 => 1 << rng.random_range(16..64),
                    2 => rng.random_range(0..64),
                    _ => rng.random(),
                };
                let end = (i + 8).min(v.len());
                v[i..end].copy_from_slice(&x.to_le_bytes()[..end - i]);
            }
        }
    }
}

/// Read everything an opened file offers; errors are fine, panics are not.
fn exercise(f: &GgufFile) {
    for (k, _) in f.metadata() {
        let _ = (
            f.uint(k),
            f.float(k),
            f.str(k),
            f.strings(k),
            f.floats(k),
            f.ints(k),
        );
    }
    for t in f.tensors() {
        let _ = (t.shape(), f.raw(t).len(), f.dequantize(&t.name));
        let _ = f.dequantize_rows(&t.name, 0..1);
    }
}

#[test]
fn five_thousand_mutated_headers_give_ok_or_an_error_never_a_panic() {
    let base = sample().bytes();
    let dir = tempfile::tempdir().unwrap();
    let path: PathBuf = dir.path().join("t.gguf");
    let mut rng = ChaCha8Rng::seed_from_u64(0x6767_7566);
    let (mut ok, mut panics) = (0, vec![]);
    for case in 0..5000 {
        let mut v = base.clone();
        mutate(&mut v, &mut rng);
        std::fs::write(&path, &v).unwrap();
        match catch_unwind(AssertUnwindSafe(|| {
            GgufFile::open(&path).map(|f| exercise(&f))
        })) {
            Ok(Ok(())) => ok += 1,
            Ok(Err(_)) => {}
            Err(p) => panics.push(format!("case {case}: {:?}", p.downcast_ref::<String>())),
        }
    }
    assert!(
        panics.is_empty(),
        "{} panics: {:?}",
        panics.len(),
        &panics[..panics.len().min(5)]
    );
    eprintln!("{ok} of 5000 mutated files opened");
    assert!(
        ok > 50,
        "only {ok} mutations stayed valid: the fuzz barely reaches the tensors"
    );
}

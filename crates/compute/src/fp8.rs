//! FP8 e4m3 (`float8_e4m3fn`) numbers on the host: the conversions the FP8 checkpoints' makers
//! use, shared by the model's loader and the checks of the GPU's FP8 kernels.

/// The e4m3 byte nearest `x`, ties to the even byte (as ml_dtypes and the published FP8
/// checkpoints round); magnitudes past 448, e4m3's largest, give +-448 (saturating, where
/// ml_dtypes would give NaN from 464 up: `WeightMap::quantize_fp8`'s quotients never reach
/// past 448 by more than a rounding), NaN gives NaN.
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a >= 448.0 {
        return sign | 0x7e;
    }
    // Scaled by a power of two (exact), the e4m3 grid around `a` is the integers: below 2^-6
    // the subnormals' steps of 2^-9 (8 rounds up into the first normal, byte 8), above it 8
    // steps a binade (16 carries into the next binade's exponent).
    let byte = if a < 2f32.powi(-6) {
        (a * 512.0).round_ties_even() as u32
    } else {
        let e = ((a.to_bits() >> 23) & 0xff) as i32 - 127;
        let steps = (a * 2f32.powi(3 - e)).round_ties_even() as u32;
        (((e + 7) as u32) << 3) + steps - 8
    };
    sign | byte as u8
}

/// An FP8 e4m3 byte (`float8_e4m3fn`: 4 exponent bits biased by 7, 3 mantissa bits, no
/// infinities, NaN where every exponent and mantissa bit is set) as f32, exactly.
pub fn e4m3_to_f32(byte: u8) -> f32 {
    let sign = if byte & 0x80 != 0 { -1.0 } else { 1.0 };
    let (exponent, mantissa) = (i32::from((byte >> 3) & 0xf), f32::from(byte & 0x7));
    if exponent == 0xf && mantissa == 7.0 {
        return f32::NAN;
    }
    let magnitude = match exponent {
        0 => mantissa / 8.0 * 2f32.powi(-6),
        e => (1.0 + mantissa / 8.0) * 2f32.powi(e - 7),
    };
    sign * magnitude
}

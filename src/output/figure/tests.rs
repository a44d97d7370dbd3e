use super::loss::centred_moving_average;
use super::*;

/// CRC-32 (IEEE) as used by PNG chunks.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = 0xFFFF_FFFFu32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// Walks a PNG's chunk structure (signature, CRCs, IHDR first, IDAT present,
/// IEND last) and returns `(width, height)` from IHDR.
fn png_size(path: &Path) -> (u32, u32) {
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(
        &bytes[..8],
        b"\x89PNG\r\n\x1a\n",
        "{} is not a PNG",
        path.display()
    );
    let mut pos = 8;
    let mut chunks = Vec::new();
    let mut size = (0, 0);
    while pos < bytes.len() {
        let len = u32::from_be_bytes(bytes[pos..pos + 4].try_into().unwrap()) as usize;
        let kind = &bytes[pos + 4..pos + 8];
        let data = &bytes[pos + 8..pos + 8 + len];
        let crc = u32::from_be_bytes(bytes[pos + 8 + len..pos + 12 + len].try_into().unwrap());
        assert_eq!(
            crc,
            crc32(&bytes[pos + 4..pos + 8 + len]),
            "bad CRC in chunk {kind:?}"
        );
        if kind == b"IHDR" {
            size = (
                u32::from_be_bytes(data[0..4].try_into().unwrap()),
                u32::from_be_bytes(data[4..8].try_into().unwrap()),
            );
        }
        chunks.push(String::from_utf8_lossy(kind).into_owned());
        pos += 12 + len;
    }
    assert_eq!(chunks.first().map(String::as_str), Some("IHDR"));
    assert_eq!(chunks.last().map(String::as_str), Some("IEND"));
    assert!(chunks.iter().any(|c| c == "IDAT"));
    size
}

fn assert_written(files: &FigureFiles, size: (u32, u32)) {
    assert!(std::fs::metadata(&files.png).unwrap().len() > 1000);
    assert_eq!(png_size(&files.png), size);
    let svg = std::fs::read_to_string(&files.svg).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains(&format!("width=\"{}\"", size.0)), "svg size");
    let dir = files.png.parent().unwrap();
    let temps = std::fs::read_dir(dir)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .contains(".tmp-")
        })
        .count();
    assert_eq!(temps, 0, "temporary files left in {}", dir.display());
}

fn sample_heatmap(diverging: bool) -> HeatmapSpec {
    let rows = 6;
    let cols = 4;
    HeatmapSpec {
        matrix: (0..rows)
            .map(|r| {
                (0..cols)
                    .map(|c| {
                        if r == 2 && c == 1 {
                            f64::NAN
                        } else {
                            (r as f64 - 2.5) * 0.3 + c as f64 * 0.1
                        }
                    })
                    .collect()
            })
            .collect(),
        row_labels: (0..rows).map(|r| format!("L{r}")).collect(),
        col_labels: (0..cols).map(|c| format!("H{c}")).collect(),
        title: "Relative change (%) at phase 3".into(),
        x_label: "KV head".into(),
        y_label: "Layer".into(),
        colorbar_label: "relative change (%)".into(),
        diverging,
        annotate: true,
        ..Default::default()
    }
}

#[test]
fn heatmap_writes_png_and_svg() {
    let dir = tempfile::tempdir().unwrap();
    for diverging in [true, false] {
        let spec = sample_heatmap(diverging);
        let base = dir.path().join(format!("figs/heat_{diverging}"));
        let files = heatmap(&base, &spec).unwrap();
        assert_eq!(
            files.png,
            dir.path().join(format!("figs/heat_{diverging}.png"))
        );
        assert_written(&files, spec.size());
        let svg = std::fs::read_to_string(&files.svg).unwrap();
        for text in ["Layer", "KV head", "relative change (%)", "L5", "H3"] {
            assert!(svg.contains(text), "svg lacks `{text}`");
        }
    }
}

#[test]
fn base_path_with_dots_keeps_its_name() {
    let dir = tempfile::tempdir().unwrap();
    let files = bar_profile(
        dir.path().join("gate_L1.5"),
        &BarProfileSpec {
            labels: vec!["0".into(), "1".into()],
            values: vec![1.5, 0.5],
            title: "g".into(),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(files.svg, dir.path().join("gate_L1.5.svg"));
}

#[test]
fn text_is_rendered() {
    check_fonts().unwrap();
    // The axis-description areas have a fixed size, so the layout is identical
    // with and without descriptions; only the glyphs differ.
    let mut spec = sample_heatmap(true);
    spec.size = Some((800, 600));
    let dark = |spec: &HeatmapSpec| {
        render_rgb(spec)
            .unwrap()
            .chunks(3)
            .filter(|p| p.iter().all(|&c| c < 100))
            .count()
    };
    let with_text = dark(&spec);
    spec.x_label.clear();
    spec.y_label.clear();
    let without = dark(&spec);
    assert!(
        with_text > without + 150,
        "axis descriptions drew {} dark pixels",
        with_text as i64 - without as i64
    );
}

#[test]
fn colour_scales() {
    let s = ColorScale::fit([-2.0, 1.0, f64::NAN], true);
    assert_eq!((s.min, s.max), (-2.0, 2.0));
    assert_eq!(s.color(0.0), RGBColor(247, 247, 247));
    assert_eq!(s.color(-2.0), RGBColor(33, 102, 172));
    assert_eq!(s.color(5.0), RGBColor(178, 24, 43));
    assert_eq!(s.color(f64::NAN), MISSING);
    let q = ColorScale::fit([1.0, 3.0], false);
    assert_eq!((q.min, q.max), (1.0, 3.0));
    assert_eq!(q.color(1.0), RGBColor(68, 1, 84));
    assert_eq!(q.color(2.0), RGBColor(33, 144, 141));
    assert_eq!(q.color(3.0), RGBColor(253, 231, 37));
    let flat = ColorScale::fit([0.0, 0.0], false);
    assert!(flat.min < flat.max);
    let zero = ColorScale::fit([0.0], true);
    assert_eq!((zero.min, zero.max), (-1.0, 1.0));
}

#[test]
fn heatmap_colours_cells_by_value() {
    // 1 x 2 matrix: -1 (blue end) and +1 (red end); sample the cell centres.
    let spec = HeatmapSpec {
        matrix: vec![vec![-1.0, 1.0]],
        row_labels: vec!["r".into()],
        col_labels: vec!["neg".into(), "pos".into()],
        title: "t".into(),
        diverging: true,
        size: Some((800, 600)),
        ..Default::default()
    };
    let buf = render_rgb(&spec).unwrap();
    let pixel = |x: usize, y: usize| {
        let i = (y * 800 + x) * 3;
        (buf[i], buf[i + 1], buf[i + 2])
    };
    let row: Vec<(u8, u8, u8)> = (0..800).map(|x| pixel(x, 300)).collect();
    assert!(row.contains(&(33, 102, 172)), "no blue cell");
    assert!(row.contains(&(178, 24, 43)), "no red cell");
    let blue = row.iter().position(|p| *p == (33, 102, 172)).unwrap();
    let red = row.iter().position(|p| *p == (178, 24, 43)).unwrap();
    assert!(blue < red, "column order");
}

#[test]
fn line_scatter_bar_loss_are_written() {
    let dir = tempfile::tempdir().unwrap();
    let x: Vec<f64> = (0..8).map(f64::from).collect();
    let y: Vec<f64> = x.iter().map(|r| 0.6 + 0.1 * (r * 0.8).sin()).collect();
    let line = LinePlotSpec {
        series: vec![
            BandSeries {
                name: "prefix padding".into(),
                x: x.clone(),
                lo: y.iter().map(|v| v - 0.05).collect(),
                hi: y.iter().map(|v| v + 0.05).collect(),
                y: y.clone(),
            },
            BandSeries {
                name: "in-sequence padding".into(),
                x: x.clone(),
                y: y.iter().map(|v| v - 0.1).collect(),
                lo: vec![f64::NAN; 8],
                hi: vec![f64::NAN; 8],
            },
        ],
        title: "Accuracy by phase".into(),
        x_label: "Source phase (t mod 8)".into(),
        y_label: "Top-1 accuracy".into(),
        y_range: Some((0.0, 1.0)),
        size: None,
    };
    let f = line_with_bands(dir.path().join("acc"), &line).unwrap();
    assert_written(&f, (1100, 700));
    assert!(
        std::fs::read_to_string(&f.svg)
            .unwrap()
            .contains("in-sequence padding")
    );

    let scatter = ScatterSpec {
        series: vec![ScatterSeries {
            name: "delta = +1".into(),
            predicted: y.clone(),
            observed: y.iter().map(|v| v + 0.01).collect(),
        }],
        title: "Gate cycling".into(),
        x_label: "Predicted accuracy".into(),
        y_label: "Observed accuracy".into(),
        ..Default::default()
    };
    let text = scatter.fit_text();
    assert!(
        text.starts_with("R² = 0.9") && text.ends_with("MAE = 0.010"),
        "{text}"
    );
    let f = scatter_predicted_vs_observed(dir.path().join("cycling"), &scatter).unwrap();
    assert_written(&f, (900, 860));
    assert!(
        std::fs::read_to_string(&f.svg)
            .unwrap()
            .contains("MAE = 0.010")
    );

    let bars = BarProfileSpec {
        labels: (0..8).map(|r| r.to_string()).collect(),
        values: vec![2.1, 1.4, 0.9, 0.6, 0.5, 0.9, 0.8, 0.8],
        title: "Key gate profile, layer 3, KV head 0".into(),
        x_label: "Offset r".into(),
        y_label: "g(r)".into(),
        reference: Some(1.0),
        reference_label: Some("uniform (g = 1)".into()),
        size: None,
    };
    let f = bar_profile(dir.path().join("gate"), &bars).unwrap();
    assert_written(&f, (1000, 650));

    let steps: Vec<u64> = (0..100).map(|s| s * 10).collect();
    let losses: Vec<f64> = steps
        .iter()
        .map(|&s| 5.0 * (-(s as f64) / 300.0).exp() + 1.0)
        .collect();
    let f = loss_curve(
        dir.path().join("loss"),
        &steps,
        &losses,
        "Training loss (kvc-w8s8)",
    )
    .unwrap();
    assert_written(&f, (1000, 620));
    assert!(
        std::fs::read_to_string(&f.svg)
            .unwrap()
            .contains("moving average")
    );
}

#[test]
fn invalid_inputs_name_the_figure() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = sample_heatmap(true);
    spec.row_labels.pop();
    let err = heatmap(dir.path().join("bad"), &spec).unwrap_err();
    assert!(matches!(err, FigureError::InvalidInput { .. }));
    assert!(
        err.to_string().contains("bad") && err.to_string().contains("row labels"),
        "{err}"
    );
    assert!(!dir.path().join("bad.png").exists());
    let err = loss_curve(dir.path().join("l"), &[1, 2], &[1.0], "x").unwrap_err();
    assert!(err.to_string().contains("2 steps for 1 losses"), "{err}");
    let ragged = HeatmapSpec {
        matrix: vec![vec![1.0, 2.0], vec![1.0]],
        row_labels: vec!["a".into(), "b".into()],
        col_labels: vec!["x".into(), "y".into()],
        ..Default::default()
    };
    assert!(heatmap(dir.path().join("r"), &ragged).is_err());
}

#[test]
fn number_formatting() {
    assert_eq!(fmt_num(3.0), "3");
    assert_eq!(fmt_num(-12.0), "-12");
    assert_eq!(fmt_num(0.30000000000000004), "0.3");
    assert_eq!(fmt_num(0.126), "0.13");
    assert_eq!(fmt_num(12.34), "12.3");
    assert_eq!(fmt_num(0.001), "1.0e-3");
    assert_eq!(fmt_num(f64::NAN), "n/a");
}

#[test]
fn moving_average_is_centred() {
    let pts: Vec<(f64, f64)> = (0..10).map(|i| (i as f64, i as f64)).collect();
    let m = centred_moving_average(&pts);
    // Window 5 (half 2): interior points of a straight line are unchanged.
    for (i, (x, y)) in m.iter().enumerate().take(8).skip(2) {
        assert_eq!((*x, *y), (i as f64, i as f64));
    }
    // Ends use the truncated window: mean of 0, 1, 2 and of 7, 8, 9.
    assert_eq!(m[0].1, 1.0);
    assert_eq!(m[9].1, 8.0);
}

#[test]
fn error_scatter_draws_labelled_points_and_refuses_empty_data() {
    let dir = tempfile::tempdir().unwrap();
    let point = |label: &str, x: f64, y: f64| ErrorPoint {
        label: label.into(),
        x,
        x_lo: x - 5.0,
        x_hi: x + 5.0,
        y,
        y_lo: y - 0.05,
        y_hi: y + 0.05,
    };
    let spec = ErrorScatterSpec {
        series: vec![
            ErrorSeries {
                name: "fail".into(),
                points: vec![point("baseline", 94.9, 0.32), point("jitter0", 91.0, 0.28)],
                color: Some(3),
            },
            ErrorSeries {
                name: "pass".into(),
                // A point without intervals draws no bars; NaN x is skipped.
                points: vec![
                    ErrorPoint {
                        label: "flat".into(),
                        x: 2.0,
                        y: 0.9,
                        x_lo: f64::NAN,
                        x_hi: f64::NAN,
                        y_lo: f64::NAN,
                        y_hi: f64::NAN,
                    },
                    point("skipped", f64::NAN, 0.5),
                ],
                color: None,
            },
        ],
        title: "frontier".into(),
        x_label: "gap (pp)".into(),
        y_label: "mean accuracy".into(),
        x_ref: Some((5.0, "gate 5 pp".into())),
        ..Default::default()
    };
    let files = error_scatter(dir.path().join("frontier"), &spec).unwrap();
    assert_written(&files, (1100, 820));
    let svg = std::fs::read_to_string(&files.svg).unwrap();
    for text in ["baseline", "jitter0", "flat", "gate 5 pp", "fail", "pass"] {
        assert!(svg.contains(text), "{text} not drawn");
    }
    assert!(
        !svg.contains("skipped"),
        "a point with a NaN x is not drawn"
    );
    let empty = ErrorScatterSpec {
        series: vec![ErrorSeries {
            name: "none".into(),
            points: vec![point("nan", f64::NAN, f64::NAN)],
            color: None,
        }],
        ..Default::default()
    };
    let err = error_scatter(dir.path().join("empty"), &empty).unwrap_err();
    assert!(
        err.to_string().contains("no point with a finite x and y"),
        "{err}"
    );
    let bad_range = ErrorScatterSpec {
        y_range: Some((1.0, 0.0)),
        ..spec
    };
    assert!(error_scatter(dir.path().join("range"), &bad_range).is_err());
}

#[test]
fn long_titles_shrink_to_fit_the_figure() {
    let measure = |t: &str, size: u32| {
        FontDesc::new(FontFamily::SansSerif, f64::from(size), FontStyle::Normal)
            .box_size(t)
            .unwrap()
            .0
    };
    // The long-context report's heatmap title with a long model name, on the 800 px
    // wide heatmap: too wide at 28 pt, fitted below it.
    let long = "v4pro-h16-2048, prefix padding: phase x prompt length, pooled over needle depths";
    assert!(measure(long, TITLE_SIZE) > 800 - 32);
    let size = title_size(long, 800, TITLE_SIZE);
    assert!((12..TITLE_SIZE).contains(&size), "{size}");
    assert!(measure(long, size) <= 800 - 32, "{size}");
    // A short title keeps the house size.
    assert_eq!(title_size("loss", 800, TITLE_SIZE), TITLE_SIZE);
}

#[test]
fn frontier_labels_overlap_nothing_and_stay_inside_the_plot() {
    use super::errorbars::{Rect, place_labels};
    let overlaps = |a: Rect, b: Rect| a.0 < b.2 && b.0 < a.2 && a.1 < b.3 && b.1 < a.3;
    // A cluster like the mitigation grid's: 8 points within 40 x 20 px, one at the
    // right edge, one at the top, long labels, a legend in the upper right.
    let mut at: Vec<(i32, i32)> = (0..8).map(|i| (700 + 5 * i, 500 + (i % 3) * 7)).collect();
    at.push((985, 300));
    at.push((400, 105));
    let sizes: Vec<(u32, u32)> = (0..at.len()).map(|i| (110 + 10 * i as u32, 18)).collect();
    let area = (100, 100, 1000, 760);
    let legend = (800, 100, 1000, 180);
    let placed = place_labels(&at, &sizes, &[legend], area);
    assert_eq!(placed.len(), at.len());
    let rects: Vec<Rect> = placed
        .iter()
        .zip(&sizes)
        .map(|(&(x, y), &(w, h))| (x, y, x + w as i32, y + h as i32))
        .collect();
    for (i, &r) in rects.iter().enumerate() {
        assert!(
            r.0 >= area.0 && r.1 >= area.1 && r.2 <= area.2 && r.3 <= area.3,
            "label {i} at {r:?} leaves the plot"
        );
        assert!(!overlaps(r, legend), "label {i} at {r:?} covers the legend");
        for (j, &o) in rects.iter().enumerate().skip(i + 1) {
            assert!(!overlaps(r, o), "labels {i} {r:?} and {j} {o:?} overlap");
        }
        for (j, &(x, y)) in at.iter().enumerate() {
            let m = (x - 7, y - 7, x + 7, y + 7);
            assert!(!overlaps(r, m), "label {i} at {r:?} covers marker {j}");
        }
    }
    // Deterministic; an uncrowded point keeps its label right above it.
    assert_eq!(place_labels(&at, &sizes, &[legend], area), placed);
    let lone = place_labels(&[(300, 400)], &[(80, 18)], &[], area);
    assert_eq!(lone, vec![(310, 372)]);
}

//! `phaselens hooks`: list every hook point with its shape.

use phaselens::hooks::Site;

pub fn run(markdown: bool) -> anyhow::Result<()> {
    if markdown {
        print!("{}", phaselens::hooks::markdown_table());
        return Ok(());
    }
    println!("{:<40} {:<60} meaning", "name", "shape");
    for site in Site::ALL {
        let info = site.info();
        let name = if info.layered {
            format!("blocks.{{l}}.{}", info.suffix)
        } else {
            info.suffix.to_string()
        };
        println!("{name:<40} {:<60} {}", info.shape, info.doc);
    }
    Ok(())
}

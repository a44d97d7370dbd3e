//! One user turn plus the generation prompt, in the two chat formats phaselens knows.
//!
//! Not a Jinja engine: the template is only recognised by its markers, and the text it
//! renders for `[{"role": "user", "content": user}]` with `add_generation_prompt=True` is
//! written out here (checked against transformers' rendering of the SmolLM2 template in
//! tests/it/tokenizer.rs).
//!
//! - ChatML (`<|im_start|>`, SmolLM2, Qwen): the default system turn the template writes
//!   when the first message is not a system message, then
//!   `<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n`.
//! - Gemma (`<start_of_turn>`): `{bos}<start_of_turn>user\n{user}<end_of_turn>\n<start_of_turn>model\n`,
//!   the BOS text only when the template writes `bos_token`, the content trimmed when it
//!   pipes it through `trim`.

/// The rendered text, or `None` for a template of another form. `bos` is the text of the
/// BOS token, for templates that write it.
pub(super) fn render(template: &str, user: &str, bos: Option<&str>) -> Option<String> {
    if template.contains("<|im_start|>") {
        let system = default_system(template)
            .map(|s| format!("<|im_start|>system\n{s}<|im_end|>\n"))
            .unwrap_or_default();
        return Some(format!(
            "{system}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        ));
    }
    if template.contains("<start_of_turn>") {
        let bos = bos.filter(|_| template.contains("bos_token")).unwrap_or("");
        let user = if template.contains("trim") {
            user.trim_matches(|c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c))
        } else {
            user
        };
        return Some(format!(
            "{bos}<start_of_turn>user\n{user}<end_of_turn>\n<start_of_turn>model\n"
        ));
    }
    None
}

/// The system message a ChatML template writes by itself: the text between
/// `<|im_start|>system` + newline and `<|im_end|>` in the template's source (the newline
/// written as a character or as the escape `\n`).
fn default_system(template: &str) -> Option<String> {
    let start = "<|im_start|>system";
    let at = template.find(start)? + start.len();
    let rest = &template[at..];
    let rest = rest
        .strip_prefix('\n')
        .or_else(|| rest.strip_prefix("\\n"))?;
    let end = rest.find("<|im_end|>")?;
    Some(rest[..end].replace("\\n", "\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_writes_the_default_system_turn_of_its_template() {
        let t = "{% if loop.first %}{{ '<|im_start|>system\\nBe brief.<|im_end|>\\n' }}{% endif %}\
                 {{'<|im_start|>' + message['role'] + '\\n'}}";
        assert_eq!(
            render(t, "hi", None).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
        let bare =
            "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'}}";
        assert_eq!(
            render(bare, "hi", None).unwrap(),
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn gemma_turns_write_bos_only_when_the_template_does() {
        let t = "{{ bos_token }}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim }}";
        assert_eq!(
            render(t, " hi\n", Some("<bos>")).unwrap(),
            "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
        );
        assert_eq!(render("{{ x }}", "hi", None), None);
    }
}

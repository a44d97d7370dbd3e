//! The text tasks' fixed wording: the passkey task's intro, needle and question, and
//! the built-in facts of the natural-text needle (each a sentence with a `{value}`
//! slot, the question that ends right before the value, and the values it draws from).

use serde::{Deserialize, Serialize};

/// The placeholder of a fact sentence and a question.
pub const VALUE_SLOT: &str = "{value}";

/// The passkey task's opening instruction.
pub const PASSKEY_INTRO: &str = "A pass key is hidden somewhere in the text below. Find it and keep it in mind, because you will be asked for it at the end.";

/// The passkey needle (the value replaces `{value}`).
pub const PASSKEY_SENTENCE: &str = "The pass key is {value}. Remember it.";

/// The passkey question; the prompt continues with a space and the value.
pub const PASSKEY_QUESTION: &str = "What is the pass key? The pass key is";

/// The natural-text needle's opening instruction.
pub const NEEDLE_INTRO: &str = "Read the following text carefully. One of its sentences states a fact that you will be asked about at the end.";

/// One fact of the natural-text needle.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fact {
    /// The needle sentence, with `{value}` exactly once.
    pub sentence: String,
    /// The final question, ending right before the value (the prompt continues with a
    /// space and the value), without `{value}`.
    pub question: String,
    /// The values the fact draws from (at least two; each the answer of some prompts and
    /// a wrong value of the others).
    pub values: Vec<String>,
}

fn fact(sentence: &str, question: &str, values: &[&str]) -> Fact {
    Fact {
        sentence: sentence.to_string(),
        question: question.to_string(),
        values: values.iter().map(|v| v.to_string()).collect(),
    }
}

/// The built-in facts (`[task.text] facts` replaces them).
pub fn builtin_facts() -> Vec<Fact> {
    vec![
        fact(
            "The secret ingredient of the soup is {value}.",
            "What is the secret ingredient of the soup? The secret ingredient of the soup is",
            &[
                "saffron", "ginger", "garlic", "cinnamon", "basil", "nutmeg", "honey", "lemon",
                "mustard", "vanilla", "thyme", "coconut",
            ],
        ),
        fact(
            "The name of the lighthouse keeper's dog is {value}.",
            "What is the name of the lighthouse keeper's dog? The name of the lighthouse keeper's dog is",
            &[
                "Oliver", "Luna", "Max", "Bella", "Felix", "Daisy", "Oscar", "Ruby", "Jasper",
                "Milo",
            ],
        ),
        fact(
            "The treasure is buried under the old {value}.",
            "Where is the treasure buried? The treasure is buried under the old",
            &[
                "oak", "chapel", "windmill", "fountain", "statue", "barn", "tower", "gate",
                "cottage", "stable",
            ],
        ),
        fact(
            "The board meeting has been moved to {value}.",
            "To which day has the board meeting been moved? The board meeting has been moved to",
            &[
                "Monday",
                "Tuesday",
                "Wednesday",
                "Thursday",
                "Friday",
                "Saturday",
                "Sunday",
            ],
        ),
        fact(
            "The new front door of the school is painted {value}.",
            "What color is the new front door of the school painted? The new front door of the school is painted",
            &[
                "red", "blue", "green", "yellow", "purple", "orange", "black", "white", "brown",
                "pink",
            ],
        ),
        fact(
            "The night train to the coast leaves from platform {value}.",
            "From which platform does the night train to the coast leave? The night train to the coast leaves from platform",
            &[
                "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
            ],
        ),
    ]
}

//! Chat templates rendered by Pulsar (minijinja) give exactly what Python's
//! jinja2 renders, set up as transformers sets it up. The cases, templates
//! and jinja2's renderings are in tests/data/chat_templates/
//! (`tools/render_chat_templates.py` rewrites the renderings).

use pulsar::chat_template::jinja::{JinjaTemplate, RenderInput};
use serde_json::{Map, Value};
use std::path::PathBuf;

fn folder() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/chat_templates")
}

fn read(name: &str) -> String {
    let path = folder().join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn every_case_renders_as_jinja2_renders_it() {
    let spec: Value = serde_json::from_str(&read("cases.json")).expect("cases.json is JSON");
    let cases = spec["cases"].as_array().expect("cases");
    assert!(cases.len() >= 6, "the cases are all there");
    let mut failures = Vec::new();
    for case in cases {
        let name = case["name"].as_str().expect("a case's name");
        let conversation =
            &spec["conversations"][case["conversation"].as_str().expect("conversation")];
        let all = conversation["messages"].as_array().expect("messages");
        let count = case["messages"].as_u64().map_or(all.len(), |n| n as usize);
        let tools = conversation["tools"].as_array().map(Vec::as_slice);
        let extra: Map<String, Value> = case["extra"].as_object().cloned().unwrap_or_default();
        let template_file = case["template"].as_str().expect("template");
        let template = JinjaTemplate::new(template_file, &read(template_file))
            .unwrap_or_else(|e| panic!("{name}: {e:#}"));
        let rendered = template
            .render(&RenderInput {
                messages: &all[..count],
                tools,
                add_generation_prompt: case["add_generation_prompt"].as_bool().expect("flag"),
                bos_token: "<bos>",
                eos_token: "<eos>",
                extra: &extra,
            })
            .unwrap_or_else(|e| panic!("{name}: {e:#}"));
        let expected = read(&format!("expected/{name}.txt"));
        if rendered != expected {
            failures.push(format!(
                "{name}:\n--- jinja2\n{expected}\n--- pulsar\n{rendered}\n"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

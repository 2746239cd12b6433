//! `--model-key` and `--model-url`, the same on `rein worker` and `rein api` (and on the
//! definition commands that check against them): the one source of where each model key may
//! be sent ([`rein_core::model_keys`]).

use rein_core::model_keys::{Binding, KeyBindings};

#[derive(clap::Args, Clone, Debug, Default)]
pub struct ModelKeyArgs {
    /// Where a model key may be sent: NAME=URL[,URL…] (repeat; in REIN_MODEL_KEYS separate
    /// bindings with `;`). A `model` state naming key NAME may call only a base_url with the
    /// same scheme, host and port whose path starts with URL's path; registration refuses
    /// others (422) and a worker fails such a call (`key_not_bound`) without sending it.
    /// Defaults: OPENAI_API_KEY=https://api.openai.com/v1 and REIN_MODEL_KEY=REIN_MODEL_URL;
    /// a binding replaces its name's default. Give the API and the workers the same.
    #[arg(long = "model-key", env = "REIN_MODEL_KEYS", value_name = "NAME=URL[,URL…]",
          value_delimiter = ';', value_parser = Binding::parse)]
    pub model_key: Vec<Binding>,
    /// The Chat Completions base URL of `model` states that give no `base_url`, e.g.
    /// `https://api.openai.com/v1`; REIN_MODEL_KEY may be sent there.
    #[arg(long, env = "REIN_MODEL_URL", value_name = "URL")]
    pub model_url: Option<String>,
}

impl ModelKeyArgs {
    /// `--model-url` when it is not empty.
    pub fn model_url(&self) -> Option<String> {
        self.model_url.clone().filter(|u| !u.trim().is_empty())
    }

    /// The bindings these flags give, over the defaults.
    pub fn bindings(&self) -> Result<KeyBindings, String> {
        KeyBindings::new(self.model_key.clone(), self.model_url().as_deref())
            .map_err(|e| format!("--model-key: {e}"))
    }
}

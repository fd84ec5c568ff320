//! The GPU model as the engine's generation loop drives it
//! (`spinfer_generate::generate_with`).

use spinfer_generate::DecodeSession;

use crate::{GpuModel, GpuSession};

/// A [`GpuModel`] and one of its sessions.
pub struct GpuDecode<'a> {
    model: &'a GpuModel,
    session: &'a mut GpuSession,
    last: usize,
}

impl<'a> GpuDecode<'a> {
    /// Drives `session` of `model`.
    pub fn new(model: &'a GpuModel, session: &'a mut GpuSession) -> Self {
        Self { model, session, last: 0 }
    }
}

impl DecodeSession for GpuDecode<'_> {
    fn ctx(&self) -> usize {
        self.model.ctx()
    }

    fn pos(&self) -> usize {
        self.session.pos()
    }

    fn reset(&mut self) {
        self.session.reset();
    }

    fn forward(&mut self, tokens: &[u32]) -> spinfer_models::Result<()> {
        self.model.forward(self.session, tokens)?;
        self.last = tokens.len();
        Ok(())
    }

    fn next_token_logits(&mut self) -> spinfer_models::Result<&[f32]> {
        if self.last == 0 {
            return Err(spinfer_models::Error::InvalidArgument("no tokens were run yet".into()));
        }
        Ok(self.model.row_logits(self.session, self.last - 1)?)
    }

    fn next_token_greedy(&mut self) -> spinfer_models::Result<Option<u32>> {
        if self.last == 0 {
            return Err(spinfer_models::Error::InvalidArgument("no tokens were run yet".into()));
        }
        Ok(Some(self.model.greedy_token(self.session, self.last - 1)?))
    }
}

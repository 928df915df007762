"""`specd train-draft`: self-distilled draft heads and small drafts for a target model."""

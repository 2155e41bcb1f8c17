"""Language adaptation: new vocabularies, embedding initialisation, embedding propagation (LEP) and
tokenizer-independent evaluation (docs/adaptation.md)."""
